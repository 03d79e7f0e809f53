"""Test support shared by the test suite, the demo and the benchmarks (real parts, no mocks)."""
