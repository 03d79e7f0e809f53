"""Cluster-scale harness: kwok's fake nodes and pods, and a fleet of real agents at their pod IPs (docs/scale.md)."""
