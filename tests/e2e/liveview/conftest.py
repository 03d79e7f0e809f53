"""The operator fixtures (a namespace, its identities, workload pods), shared with tests/e2e/operator."""

from tests.e2e.operator.conftest import namespace, operator_identity, pods, token_file

__all__ = ["namespace", "operator_identity", "pods", "token_file"]
