"""Who is calling: projected ServiceAccount tokens, verified offline against the cluster's issuer keys.

Why no shared secret: a bearer token copied into every namespace lets any workload act as the
operator. Instead every caller presents its own projected ServiceAccount token (audience
`gpuobj_contract.names.AGENT_AUDIENCE`, short expiry, rotated by the kubelet). The agent checks
the signature against the API server's service-account issuer keys (`/.well-known/openid-
configuration` and `/openid/v1/jwks`, fetched once, cached, fetched again when a token names an
unknown key id, at most every `min_refresh` seconds), then the issuer, audience and expiry. No
call to the API server per request: verification is offline, so the ticket path stays fast.

What the identity allows is decided here too, in two questions the server asks:
- `operator(header)`: free, inventory, materialize, stream-free, info. Only the operator's
  ServiceAccount(s), named in the agent's configuration (`--operator-serviceaccount`).
- `reader(header)`: a read ticket. A token bound to a pod (Kubernetes puts the pod's name and uid
  in the token's `kubernetes.io` claim); whether that pod may read a given object is the store's
  question (`ObjectStore.authorize_read`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlparse

import aiohttp
import jwt

from gpuobj_agent.errors import AgentError, Unauthorized
from gpuobj_kube.bodies import BodyTooLarge, read_bounded

log = logging.getLogger(__name__)

# Kubernetes signs ServiceAccount tokens with RS256 or ES256 (the key type of --service-account-signing-key-file).
ALGORITHMS = ("RS256", "RS384", "RS512", "ES256", "ES384", "ES512")
MAX_TOKEN_CHARS = 16 << 10
MAX_JWKS_BYTES = 1 << 20
LEEWAY_SECONDS = 30.0
VERIFIED_CACHE = 1024
SA_PREFIX = "system:serviceaccount:"


class Forbidden(AgentError):
    """A valid identity that may not do this (HTTP 403)."""

    status = 403


class IssuerError(RuntimeError):
    """The issuer's discovery document or keys could not be read."""


def service_account_subject(spec: str) -> str:
    """`namespace/name`, `namespace:name` or a full `system:serviceaccount:ns:name` -> the full subject."""
    if spec.startswith(SA_PREFIX):
        spec = spec[len(SA_PREFIX) :]
    sep = "/" if "/" in spec else ":"
    ns, _, name = spec.partition(sep)
    if not ns or not name or sep in name:
        raise ValueError(f"not a ServiceAccount (want namespace/name): {spec!r}")
    return f"{SA_PREFIX}{ns}:{name}"


@dataclass(frozen=True)
class Caller:
    """The verified identity behind a request."""

    subject: str  # system:serviceaccount:<namespace>:<name>
    namespace: str
    service_account: str
    pod_name: str | None = None
    pod_uid: str | None = None

    @property
    def pod(self) -> str | None:
        return f"{self.namespace}/{self.pod_name}" if self.pod_name else None


def caller_from_claims(claims: dict[str, Any]) -> Caller:
    """The identity in a verified token's claims (Kubernetes' `kubernetes.io` claim, else `sub`)."""
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub.startswith(SA_PREFIX):
        raise Unauthorized("the token is not a ServiceAccount token")
    ns, _, name = sub[len(SA_PREFIX) :].partition(":")
    if not ns or not name:
        raise Unauthorized("the token's subject names no ServiceAccount")
    k8s = claims.get("kubernetes.io")
    pod_name = pod_uid = None
    if isinstance(k8s, dict):
        if k8s.get("namespace") not in (None, ns):
            raise Unauthorized("the token's namespace claims disagree")
        pod = k8s.get("pod")
        if isinstance(pod, dict) and isinstance(pod.get("name"), str) and isinstance(pod.get("uid"), str):
            pod_name, pod_uid = pod["name"], pod["uid"]
    return Caller(sub, ns, name, pod_name, pod_uid)


class IssuerKeys:
    """The issuer's signing keys, fetched from `base_url` and cached; refreshed on an unknown key id.

    `base_url` is the API server (its `/.well-known/openid-configuration` names the issuer, and
    `/openid/v1/jwks` serves the keys; the discovery document's `jwks_uri` host is often not
    reachable from a pod, so only its path is used, on `base_url`). Reading them needs a credential
    on most clusters: real ones bind `system:service-account-issuer-discovery` to every
    ServiceAccount, so the pod's own token is enough.
    """

    def __init__(
        self,
        base_url: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        bearer: Callable[[], str | None] = lambda: None,
        min_refresh: float = 10.0,
        max_age: float = 3600.0,
        timeout: float = 10.0,
    ) -> None:
        self.base_url = base_url.rstrip("/") + "/"
        self.ssl_context = ssl_context
        self.bearer = bearer
        self.min_refresh = min_refresh
        self.max_age = max_age
        self.timeout = timeout
        self.issuer: str | None = None
        self._keys: dict[str, jwt.PyJWK] = {}
        self._fetched = -float("inf")
        self._attempted = -float("inf")
        self._lock = asyncio.Lock()
        self.fetches = 0

    async def _get_json(self, session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
        token = self.bearer()
        headers = {
            "Accept": "application/json, application/jwk-set+json",
            **({"Authorization": f"Bearer {token}"} if token else {}),
        }
        async with session.get(url, headers=headers, ssl=self.ssl_context or True) as resp:
            try:
                body = await read_bounded(resp, MAX_JWKS_BYTES, f"GET {url}")
            except BodyTooLarge as exc:
                raise IssuerError(str(exc)) from None
            if resp.status != 200:
                raise IssuerError(f"GET {url} answered {resp.status}: {body[:200]!r}")
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise IssuerError(f"GET {url}: not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise IssuerError(f"GET {url}: not a JSON object")
        return data

    async def refresh(self) -> None:
        """Fetch discovery and keys now."""
        self._attempted = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            discovery = await self._get_json(session, urljoin(self.base_url, ".well-known/openid-configuration"))
            issuer = discovery.get("issuer")
            if not isinstance(issuer, str) or not issuer:
                raise IssuerError("the discovery document names no issuer")
            jwks_path = urlparse(str(discovery.get("jwks_uri") or "/openid/v1/jwks")).path or "/openid/v1/jwks"
            jwks = await self._get_json(session, urljoin(self.base_url, jwks_path.lstrip("/")))
        keys: dict[str, jwt.PyJWK] = {}
        for entry in jwks.get("keys") or []:
            if not isinstance(entry, dict) or entry.get("use", "sig") != "sig":
                continue
            try:
                key = jwt.PyJWK(entry)
            except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError) as exc:
                log.warning("skipping an unusable issuer key %s: %s", entry.get("kid"), exc)
                continue
            keys[str(entry.get("kid", ""))] = key
        if not keys:
            raise IssuerError("the issuer published no usable signing key")
        self.issuer, self._keys = issuer, keys
        self._fetched = time.monotonic()
        self.fetches += 1
        log.info("issuer %s: %d signing key(s)", issuer, len(keys))

    async def key(self, kid: str) -> tuple[str, jwt.PyJWK] | None:
        """(issuer, key) for a key id; fetches when unknown or stale, never more often than min_refresh."""
        now = time.monotonic()
        issuer = self.issuer  # set with the keys (refresh), so known whenever `kid` is
        if kid in self._keys and issuer is not None and now - self._fetched < self.max_age:
            return issuer, self._keys[kid]
        async with self._lock:
            now = time.monotonic()
            stale = kid not in self._keys or now - self._fetched >= self.max_age
            if stale and now - self._attempted >= self.min_refresh:
                try:
                    await self.refresh()
                except (IssuerError, aiohttp.ClientError, TimeoutError, OSError) as exc:
                    log.warning("cannot refresh the issuer keys from %s: %s", self.base_url, exc)
            found = self._keys.get(kid)
            return (self.issuer, found) if found is not None and self.issuer else None


class RevocationUnknown(AgentError):
    """The agent could not learn for too long whether a token was revoked: it refuses (fail closed)."""

    status = 503


@dataclass
class _Review:
    """What TokenReview last said of one token."""

    valid_at: float = -float("inf")  # monotonic time of the last review that found it valid
    revoked: bool = False
    pending: asyncio.Task[None] | None = None


class Revocations:
    """Whether a verified token still stands: its pod and ServiceAccount still exist (TokenReview).

    Why: a signature and `exp` cannot say that the token's pod or ServiceAccount was deleted; only the API
    server knows (it refuses such a token at once: "service account token has been invalidated"). Offline
    verification stays the fast path: a token the API server confirmed less than `refresh` seconds ago
    passes with no call; up to `stale` seconds it passes and is reviewed again in the background (one
    review in flight per token); beyond that the request waits for a review. So a token is refused by
    the first request more than `stale` seconds (plus one review) after its pod or ServiceAccount went.
    When reviews fail (the API server unreachable, or no right to `create tokenreviews`), tokens still
    pass on their offline checks while the last review that got an answer (of any token) is less than
    `fail_closed_after` seconds old; past that the agent refuses every token (503): it never goes longer
    than that without news of revocations. A revoked token stays refused.
    """

    def __init__(
        self,
        base_url: str,
        *,
        audience: str,
        ssl_context: ssl.SSLContext | None = None,
        bearer: Callable[[], str | None] = lambda: None,
        refresh: float = 2.0,
        stale: float = 4.0,
        fail_closed_after: float = 60.0,
        timeout: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = urljoin(base_url.rstrip("/") + "/", "apis/authentication.k8s.io/v1/tokenreviews")
        self.audience = audience
        self.ssl_context = ssl_context
        self.bearer = bearer
        self.refresh, self.stale, self.fail_closed_after = refresh, stale, fail_closed_after
        self.timeout = timeout
        self.clock = clock
        self._reviews: dict[str, _Review] = {}
        self._session: aiohttp.ClientSession | None = None
        self._answered = clock()  # the last review the API server answered (from the start: a grace to reach it)
        self._failed = -float("inf")  # the last review that got no answer
        self.calls = 0

    async def _ask(self, token: str) -> bool:
        """TokenReview's verdict: True if the token authenticates for our audience now, False if not."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        own = self.bearer()
        # The API server caches a token's authentication for 10 s, keyed by the token and the audiences asked
        # for: a second audience of our own, new each time, makes it look again (its pod, its ServiceAccount,
        # from its informers: cheap), so a deletion is seen at once, not up to 10 s later. The answer's
        # audiences are the intersection: ours, if the token is for us.
        once = f"{self.audience}/review-{secrets.token_hex(8)}"
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [self.audience, once]},
        }
        headers = {"Authorization": f"Bearer {own}"} if own else {}
        self.calls += 1
        async with self._session.post(self.url, json=body, headers=headers, ssl=self.ssl_context or True) as resp:
            try:
                raw = await read_bounded(resp, MAX_JWKS_BYTES, "TokenReview")
            except BodyTooLarge as exc:
                raise IssuerError(str(exc)) from None
            if resp.status not in (200, 201):
                raise IssuerError(f"TokenReview answered {resp.status}: {raw[:200]!r}")
        try:
            status = json.loads(raw).get("status") or {}
        except (ValueError, AttributeError) as exc:
            raise IssuerError(f"TokenReview answered something that is not a TokenReview: {exc}") from None
        return bool(status.get("authenticated")) and self.audience in (status.get("audiences") or [])

    async def _review(self, token: str, entry: _Review) -> None:
        try:
            valid = await self._ask(token)
        except (IssuerError, aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("cannot review a token with the API server (%s): %s", self.url, exc)
            self._failed = self.clock()
            return
        self._answered = self.clock()
        if valid:
            entry.valid_at = self.clock()
        else:
            entry.revoked = True
            log.info("a caller's token was revoked (its pod or ServiceAccount no longer exists)")

    async def check(self, token: str) -> None:
        """Return if the token stands; Unauthorized if it was revoked; RevocationUnknown if no news for too long."""
        entry = self._reviews.get(token)
        if entry is None:
            if len(self._reviews) >= VERIFIED_CACHE:
                # bounded like the verified cache; reviews in flight keep their entry
                self._reviews = {t: e for t, e in self._reviews.items() if e.pending and not e.pending.done()}
            entry = self._reviews[token] = _Review()
        now = self.clock()
        age = now - entry.valid_at
        # While reviews fail, try again at most every `refresh` seconds and make no request wait for one.
        reachable = now - self._failed >= self.refresh
        if not entry.revoked and age >= self.refresh and reachable:
            if entry.pending is None or entry.pending.done():
                entry.pending = asyncio.create_task(self._review(token, entry), name="gpuobj-token-review")
            if age >= self.stale:
                await asyncio.shield(entry.pending)  # shielded: a cancelled request does not cancel the review
        if entry.revoked:
            raise Unauthorized("the bearer token was revoked: its pod or ServiceAccount no longer exists")
        if self.clock() - self._answered >= self.fail_closed_after:
            raise RevocationUnknown(
                f"cannot learn from the API server whether this token was revoked (no review for "
                f"{self.fail_closed_after:.0f}s); refused until it answers"
            )

    def forget(self, token: str) -> None:
        self._reviews.pop(token, None)

    async def close(self) -> None:
        for entry in self._reviews.values():
            if entry.pending is not None and not entry.pending.done():
                entry.pending.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None


class ServiceAccountAuth:
    """Verifies callers' projected tokens and answers who may do what."""

    def __init__(
        self,
        keys: IssuerKeys,
        *,
        audience: str,
        operators: frozenset[str],
        revocations: Revocations | None = None,
    ) -> None:
        if not operators:
            raise ValueError("name the operator's ServiceAccount (--operator-serviceaccount namespace/name)")
        self.keys = keys
        self.audience = audience
        self.operators = frozenset(service_account_subject(s) for s in operators)
        # None: tokens are checked offline only (no API server to ask: a test issuer, or a local agent).
        self.revocations = revocations
        # Verified tokens, until they expire: the same token comes back on every call of one caller,
        # and a signature check (tens of microseconds) need not be repeated on the ticket path.
        self._verified: dict[str, tuple[Caller, float]] = {}

    @staticmethod
    def _bearer(authorization: str | None) -> str:
        if not authorization:
            raise Unauthorized("missing bearer token")
        if not authorization.isascii() or not authorization.isprintable():
            raise Unauthorized("malformed Authorization header")
        scheme, _, value = authorization.partition(" ")
        value = value.strip()
        if scheme.lower() != "bearer" or not value:
            raise Unauthorized("missing bearer token")
        if len(value) > MAX_TOKEN_CHARS:
            raise Unauthorized("bearer token too long")
        return value

    async def identify(self, authorization: str | None) -> Caller:
        """The verified caller, or Unauthorized saying why (never anything else)."""
        token = self._bearer(authorization)
        caller = await self._verify(token)
        if self.revocations is not None:
            await self.revocations.check(token)
        return caller

    async def _verify(self, token: str) -> Caller:
        """Signature, issuer, audience and expiry, offline; verified tokens cached until they expire."""
        hit = self._verified.get(token)
        if hit is not None:
            if time.time() < hit[1]:
                return hit[0]
            del self._verified[token]
            if self.revocations is not None:
                self.revocations.forget(token)
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise Unauthorized("the bearer token is not a signed JWT") from None
        alg, kid = header.get("alg"), header.get("kid", "")
        if alg not in ALGORITHMS or not isinstance(kid, str):
            raise Unauthorized("the bearer token's signing algorithm is not accepted")
        found = await self.keys.key(kid)
        if found is None:
            raise Unauthorized("the bearer token is signed by an unknown key")
        issuer, key = found
        try:
            claims = jwt.decode(
                token,
                key.key,
                algorithms=[alg],
                audience=self.audience,
                issuer=issuer,
                leeway=LEEWAY_SECONDS,
                options={"require": ["exp", "iat", "iss", "sub", "aud"]},
            )
        except jwt.ExpiredSignatureError:
            raise Unauthorized("the bearer token has expired") from None
        except jwt.InvalidAudienceError:
            raise Unauthorized(f"the bearer token is not for audience {self.audience}") from None
        except jwt.PyJWTError as exc:
            raise Unauthorized(f"the bearer token is not valid: {exc}") from None
        caller = caller_from_claims(claims)
        if len(self._verified) >= VERIFIED_CACHE:
            self._verified.clear()  # bounded: a flood of distinct valid tokens costs verifications, not memory
        self._verified[token] = (caller, float(claims["exp"]))
        return caller

    async def close(self) -> None:
        if self.revocations is not None:
            await self.revocations.close()

    async def operator(self, authorization: str | None) -> Caller:
        caller = await self.identify(authorization)
        if caller.subject not in self.operators:
            raise Forbidden(f"{caller.subject} is not the gpuobj operator")
        return caller

    async def reader(self, authorization: str | None) -> Caller:
        caller = await self.identify(authorization)
        if not caller.pod_name or not caller.pod_uid:
            raise Forbidden(f"{caller.subject}: a read needs a pod-bound token (a projected ServiceAccount token)")
        return caller
