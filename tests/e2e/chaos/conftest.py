"""The chaos suite shares the operator tests' fixtures: a namespace, the agents' token, workload pods."""

from tests.e2e.operator.conftest import namespace, operator_identity, pods, token_file  # noqa: F401
