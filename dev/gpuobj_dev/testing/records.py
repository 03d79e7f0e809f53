"""What the API holds, as a test sees it: the claims that reference objects, without the operator's marker."""

from __future__ import annotations

from gpuobj_contract import names


def user_claims(claims: list[dict]) -> list[dict]:
    """Claims other than the operator's progress marker, a claim that holds nothing
    (operator/gpuobj_operator/progress_marker.py): a test that checks nothing is left means these."""
    return [c for c in claims if c["metadata"]["name"] != names.CLAIMS_PROGRESS_MARKER]


def user_records(names_output: str) -> list[str]:
    """`kubectl get gpuobj -o name` output as a list, without the operator's progress marker."""
    marker = f"{names.KIND_CLAIM.lower()}.{names.GROUP}/{names.CLAIMS_PROGRESS_MARKER}"
    return [n for n in names_output.split() if n != marker]
