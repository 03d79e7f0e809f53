"""The chaos suite shares the operator tests' fixtures: a namespace per test and the agents' token."""

from tests.operator.conftest import namespace, token_file  # noqa: F401
