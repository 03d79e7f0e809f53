"""A ServiceAccount token issuer on loopback, for agent tests that run without a control plane.

Why: the agent verifies callers' projected tokens against an issuer's published keys. Agent tests
(transfers, fencing, tickets) run without an API server; this serves the same two documents a
kube-apiserver serves (`/.well-known/openid-configuration`, `/openid/v1/jwks`) over real HTTP,
and signs tokens shaped as Kubernetes signs them (`sub`, `aud`, `kubernetes.io` with namespace,
ServiceAccount and pod). The end-to-end suites use the real API server's issuer instead
(gpuobj_dev.testing.identities).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

from gpuobj_contract import names

OPERATOR = "gpuobj-system/gpuobj-operator"


class TestIssuer:
    """Start with `start()`, mint with `token(...)`, stop with `stop()`."""

    __test__ = False  # not a pytest class

    def __init__(self) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.kid = uuid.uuid4().hex
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.requests = 0

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def jwks(self) -> dict:
        public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key()))
        return {"keys": [{**public, "kid": self.kid, "use": "sig", "alg": "RS256"}]}

    def rotate(self) -> None:
        """A new signing key: tokens signed before are refused once the agent re-reads the keys."""
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.kid = uuid.uuid4().hex

    def start(self) -> TestIssuer:
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                issuer.requests += 1
                if self.path == "/.well-known/openid-configuration":
                    body = {"issuer": issuer.url, "jwks_uri": f"{issuer.url}/openid/v1/jwks"}
                elif self.path == "/openid/v1/jwks":
                    body = issuer.jwks()
                else:
                    self.send_error(404)
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="test-issuer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def token(
        self,
        service_account: str,
        *,
        pod: tuple[str, str] | None = None,
        audience: str = names.AGENT_AUDIENCE,
        lifetime: float = 3600.0,
        issuer: str | None = None,
    ) -> str:
        """A token for `namespace/name`, bound to `pod` (name, uid) when given."""
        ns, _, name = service_account.partition("/")
        now = int(time.time())
        k8s: dict = {
            "namespace": ns,
            "serviceaccount": {"name": name, "uid": str(uuid.uuid5(uuid.NAMESPACE_URL, name))},
        }
        if pod is not None:
            k8s["pod"] = {"name": pod[0], "uid": pod[1]}
        claims = {
            "iss": issuer or self.url,
            "aud": [audience],
            "sub": f"system:serviceaccount:{ns}:{name}",
            "iat": now,
            "nbf": now,
            "exp": now + int(lifetime),
            "jti": uuid.uuid4().hex,
            "kubernetes.io": k8s,
        }
        return jwt.encode(claims, self.key, algorithm="RS256", headers={"kid": self.kid})


_DEFAULT: TestIssuer | None = None
_DEFAULT_LOCK = threading.Lock()


def default_issuer() -> TestIssuer:
    """One issuer per test process, so every agent it starts trusts the same keys."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = TestIssuer().start()
        return _DEFAULT
