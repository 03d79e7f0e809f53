"""Projected ServiceAccount tokens, verified offline against the issuer's published keys.

The issuer here is gpuobj_dev.testing.issuer over real HTTP; tests/security checks the same
verifier against the real API server's keys and tokens from the TokenRequest API.
"""

from __future__ import annotations

import asyncio

import jwt
import pytest

from gpuobj_agent.auth import Caller, Forbidden, IssuerKeys, ServiceAccountAuth, service_account_subject
from gpuobj_agent.errors import Unauthorized
from gpuobj_agent.main import main
from gpuobj_dev.testing.issuer import OPERATOR, TestIssuer


@pytest.fixture
def issuer():
    iss = TestIssuer().start()
    yield iss
    iss.stop()


def _auth(issuer: TestIssuer, **kw) -> ServiceAccountAuth:
    return ServiceAccountAuth(IssuerKeys(issuer.url, **kw), audience="gpuobj.io/agent", operators=frozenset([OPERATOR]))


def _run(coro):
    return asyncio.run(coro)


def test_the_operator_token_is_accepted_and_names_the_operator(issuer):
    auth = _auth(issuer)
    caller = _run(auth.operator("Bearer " + issuer.token(OPERATOR)))
    assert caller == Caller("system:serviceaccount:gpuobj-system:gpuobj-operator", "gpuobj-system", "gpuobj-operator")


def test_a_pod_token_names_its_pod_and_is_no_operator(issuer):
    auth = _auth(issuer)
    token = issuer.token("ml/trainer", pod=("trainer-0", "uid-0"))
    caller = _run(auth.reader("bearer " + token))
    assert (caller.namespace, caller.pod_name, caller.pod_uid) == ("ml", "trainer-0", "uid-0")
    with pytest.raises(Forbidden):
        _run(auth.operator("Bearer " + token))
    with pytest.raises(Forbidden, match="pod-bound"):
        _run(auth.reader("Bearer " + issuer.token("ml/trainer")))  # not bound to a pod


def test_bad_tokens_are_refused_with_a_reason(issuer):
    auth = _auth(issuer)
    other = TestIssuer()  # same shape, keys nobody published
    other.kid = issuer.kid
    expired = issuer.token(OPERATOR, lifetime=-120)
    cases = {
        None: "missing",
        "": "missing",
        "Bearer": "missing",
        "Basic " + issuer.token(OPERATOR): "missing",
        "Bearer not-a-jwt": "not a signed JWT",
        "Bearer \udcff\udcfe": "malformed",
        "Bearer " + "a" * 20000: "too long",
        "Bearer " + issuer.token(OPERATOR, audience="https://kubernetes.default.svc"): "audience",
        "Bearer " + issuer.token(OPERATOR, issuer="https://elsewhere"): "not valid",
        "Bearer " + expired: "expired",
        "Bearer " + other.token(OPERATOR, issuer=issuer.url): "not valid",
        "Bearer " + jwt.encode({"sub": "x"}, "k" * 32, algorithm="HS256"): "algorithm",
        "Bearer " + jwt.encode({"sub": "x"}, None, algorithm="none"): "algorithm",
    }
    for header, reason in cases.items():
        with pytest.raises(Unauthorized, match=reason):
            _run(auth.identify(header))


def test_a_rotated_issuer_key_is_fetched_on_its_first_use(issuer):
    async def go():
        auth = _auth(issuer, min_refresh=0.0)
        await auth.operator("Bearer " + issuer.token(OPERATOR))
        fetches = auth.keys.fetches
        await auth.operator("Bearer " + issuer.token(OPERATOR))
        assert auth.keys.fetches == fetches  # cached: no fetch per request
        old = issuer.token(OPERATOR)
        issuer.rotate()
        await auth.operator("Bearer " + issuer.token(OPERATOR))  # unknown kid: fetched again
        assert auth.keys.fetches == fetches + 1
        with pytest.raises(Unauthorized, match="unknown key"):
            await auth.operator("Bearer " + old)  # the retired key is gone from the published set

    _run(go())


def test_unknown_key_ids_do_not_hammer_the_issuer(issuer):
    async def go():
        auth = _auth(issuer, min_refresh=3600.0)
        await auth.keys.refresh()
        before = issuer.requests
        stranger = TestIssuer()
        for _ in range(50):
            with pytest.raises(Unauthorized):
                await auth.identify("Bearer " + stranger.token(OPERATOR, issuer=issuer.url))
        assert issuer.requests == before  # refreshes are rate-limited

    _run(go())


def test_service_account_spellings():
    full = "system:serviceaccount:a:b"
    assert service_account_subject("a/b") == service_account_subject("a:b") == service_account_subject(full) == full
    for bad in ("", "a", "a/", "/b", "a/b/c"):
        with pytest.raises(ValueError):
            service_account_subject(bad)


def test_an_agent_without_an_issuer_or_operator_refuses_to_start(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config, not in a cluster
    assert main(["--pod-name", "p", "--port", "0", "--host", "127.0.0.1"]) == 2
    assert "kubeconfig" in capsys.readouterr().err
