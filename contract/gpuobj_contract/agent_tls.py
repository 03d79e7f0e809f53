"""Names in agent certificates: what the signer writes, the agent asks for, and callers verify.

Why here: three parts must agree on them byte for byte (the operator's signer, the agent that asks for
its certificate, and every caller that checks the certificate before it sends a token). A caller connects
to the pod's IP and verifies the DNS name `pod_dns_name` (it carries the pod uid), so a pod at another
IP, or another pod at this IP, cannot pass the TLS handshake: no request, no token, goes out first.
"""

from __future__ import annotations

# The CertificateSigningRequest signer the operator runs (docs/security.md, "TLS to agents").
SIGNER_NAME = "gpuobj.io/agent-serving"
# Usages an agent asks for: it serves TLS, and presents the same certificate when it reads from another agent.
USAGES = ("digital signature", "server auth", "client auth")
# Longest life of an agent certificate; agents renew at RENEW_FRACTION of it.
MAX_LIFETIME_SECONDS = 3600
MIN_LIFETIME_SECONDS = 600  # the CSR API's own floor for spec.expirationSeconds
RENEW_FRACTION = 2 / 3
# The Secret (in the operator's namespace) holding the CA key and certificate: created once by the operator.
CA_SECRET_SUFFIX = "agent-ca"
CA_SECRET_LABELS = {"app.kubernetes.io/component": "agent-ca"}  # on the CA Secret the operator creates
DNS_SUFFIX = "pod.gpuobj.io"
SPIFFE_TRUST_DOMAIN = "gpuobj.io"
# Every CSR an agent makes is named with this prefix (and its pod uid): the operator lists nothing else.
CSR_PREFIX = "gpuobj-agent-"


def pod_dns_name(pod_uid: str) -> str:
    """The name a caller verifies: `<uid>.pod.gpuobj.io`. A pod uid is unique in the cluster and over time
    (a DNS label, too), so it alone names the pod; callers know it wherever they know the pod."""
    return f"{pod_uid}.{DNS_SUFFIX}"


def pod_uri(namespace: str, pod_name: str, pod_uid: str) -> str:
    """The pod's SPIFFE-style identity, for logs and for checking a client certificate."""
    return f"spiffe://{SPIFFE_TRUST_DOMAIN}/ns/{namespace}/pod/{pod_name}/{pod_uid}"


def service_account_uri(namespace: str, name: str) -> str:
    """A ServiceAccount's identity (the operator's client certificate names its own)."""
    return f"spiffe://{SPIFFE_TRUST_DOMAIN}/ns/{namespace}/sa/{name}"


def parse_uri(uri: str) -> tuple[str, str, str, str] | None:
    """("pod", namespace, name, uid) or ("sa", namespace, name, "") from one of our URIs, else None."""
    prefix = f"spiffe://{SPIFFE_TRUST_DOMAIN}/ns/"
    if not uri.startswith(prefix):
        return None
    parts = uri[len(prefix) :].split("/")
    if len(parts) == 4 and parts[1] == "pod" and all(parts):
        return ("pod", parts[0], parts[2], parts[3])
    if len(parts) == 3 and parts[1] == "sa" and all(parts):
        return ("sa", parts[0], parts[2], "")
    return None
