"""The credentials loader: every kind of kubeconfig user a platform engineer has, and clear errors.

Real files and real exec plugins (small scripts); no API server needed: what is checked is the
Authorization header, the expiry and the TLS material a request would carry.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import stat
import sys
from pathlib import Path

import pytest
import yaml

from gpuobj_kube.config import KubeConfigError, from_kubeconfig

SERVER = "https://127.0.0.1:6443"


def _kubeconfig(user: dict, *, cluster: dict | None = None, context_cluster: str = "dev") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "dev", "cluster": cluster or {"server": SERVER, "insecure-skip-tls-verify": True}}],
        "users": [{"name": "me", "user": user}],
        "contexts": [{"name": "dev", "context": {"cluster": context_cluster, "user": "me", "namespace": "team-a"}}],
        "current-context": "dev",
    }


def _write(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def _exec_plugin(tmp_path: Path, *, token: str, expires_in: dt.timedelta | None, fail: bool = False) -> dict:
    """A kubeconfig `exec` user whose plugin prints an ExecCredential and counts its runs in a file."""
    runs = tmp_path / "runs"
    status: dict = {"token": token}
    if expires_in is not None:
        status["expirationTimestamp"] = (dt.datetime.now(dt.UTC) + expires_in).strftime("%Y-%m-%dT%H:%M:%SZ")
    credential = {"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": status}
    script = tmp_path / "get-token.py"
    body = (
        "import sys\n"
        f"with open({str(runs)!r}, 'a') as f: f.write('run\\n')\n"
        + ("sys.stderr.write('plugin: no session, run login first'); sys.exit(1)\n" if fail else "")
        + f"print({json.dumps(json.dumps(credential))})\n"
    )
    script.write_text(body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": [str(script)],
            "interactiveMode": "Never",
        }
    }


def _runs(tmp_path: Path) -> int:
    f = tmp_path / "runs"
    return len(f.read_text().splitlines()) if f.exists() else 0


def test_exec_plugin_token_is_used_with_its_expiry_and_refreshed_after_invalidate(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "config", _kubeconfig(_exec_plugin(tmp_path, token="t-1", expires_in=dt.timedelta(hours=1)))
    )
    config = from_kubeconfig(path)
    creds = config.credentials()
    assert creds.authorization == "Bearer t-1"
    assert creds.server == SERVER and creds.namespace == "team-a" and creds.insecure
    assert creds.expiry is not None and dt.timedelta(minutes=55) < creds.expiry - dt.datetime.now(dt.UTC)
    runs = _runs(tmp_path)
    config.credentials()  # not expired: no new run
    assert _runs(tmp_path) == runs
    config.invalidate()  # what a 401 does
    assert _runs(tmp_path) == runs + 1


def test_exec_plugin_token_already_expired_is_loaded_again_on_use(tmp_path: Path) -> None:
    path = _write(tmp_path / "config", _kubeconfig(_exec_plugin(tmp_path, token="t-2", expires_in=dt.timedelta(0))))
    config = from_kubeconfig(path)
    assert config.needs_refresh()
    runs = _runs(tmp_path)
    assert config.authorization() == "Bearer t-2"
    assert _runs(tmp_path) > runs


def test_exec_plugin_that_fails_is_a_clear_error_naming_the_context(tmp_path: Path) -> None:
    user = _exec_plugin(tmp_path, token="x", expires_in=None, fail=True)
    path = _write(tmp_path / "config", _kubeconfig(user))
    with pytest.raises(KubeConfigError, match=r"context 'dev'") as err:
        from_kubeconfig(path)
    assert "exec" in str(err.value).lower() or "plugin" in str(err.value).lower()


def test_auth_provider_token_is_used(tmp_path: Path) -> None:
    expiry = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    user = {"auth-provider": {"name": "gcp", "config": {"access-token": "ya29.token", "expiry": expiry}}}
    config = from_kubeconfig(_write(tmp_path / "config", _kubeconfig(user)))
    assert config.authorization() == "Bearer ya29.token"
    assert config.credentials().expiry is not None


def test_oidc_auth_provider_id_token_is_used(tmp_path: Path) -> None:
    def b64(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    exp = int((dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).timestamp())
    id_token = f"{b64({'alg': 'RS256'})}.{b64({'sub': 'me', 'exp': exp})}.c2lnbmF0dXJl"
    user = {"auth-provider": {"name": "oidc", "config": {"id-token": id_token, "client-id": "k8s"}}}
    config = from_kubeconfig(_write(tmp_path / "config", _kubeconfig(user)))
    assert config.authorization() == f"Bearer {id_token}"


def test_token_file_is_read_again_after_invalidate(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    config = from_kubeconfig(_write(tmp_path / "config", _kubeconfig({"tokenFile": str(token)})))
    assert config.authorization() == "Bearer first"
    token.write_text("rotated\n")
    config.invalidate()
    assert config.authorization() == "Bearer rotated"


def test_multi_file_kubeconfig_merges_like_kubectl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = _kubeconfig({"token": "from-b"})
    clusters = {"apiVersion": "v1", "kind": "Config", "clusters": full["clusters"]}
    rest = {k: v for k, v in full.items() if k != "clusters"}
    a = _write(tmp_path / "a", clusters)
    b = _write(tmp_path / "b", rest)
    monkeypatch.setenv("KUBECONFIG", f"{a}:{tmp_path / 'missing'}:{b}")
    config = from_kubeconfig()
    assert (config.server, config.authorization()) == (SERVER, "Bearer from-b")


def test_context_naming_a_missing_cluster_is_a_clear_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "config", _kubeconfig({"token": "t"}, context_cluster="nowhere"))
    with pytest.raises(KubeConfigError, match="nowhere"):
        from_kubeconfig(path)


def test_missing_context_and_missing_file_are_clear_errors(tmp_path: Path) -> None:
    path = _write(tmp_path / "config", _kubeconfig({"token": "t"}))
    with pytest.raises(KubeConfigError, match="other"):
        from_kubeconfig(path, context="other")
    with pytest.raises(KubeConfigError, match="no kubeconfig found"):
        from_kubeconfig(tmp_path / "absent")


def test_client_certificate_user_builds_a_tls_context(tmp_path: Path) -> None:
    from gpuobj_dev.pki import DevPKI

    pki = DevPKI(tmp_path / "pki")
    pki.create()
    pair = pki.issue("alice", "alice", org="dev")
    cluster = {"server": SERVER, "certificate-authority": str(pki.ca.cert)}
    user = {"client-certificate": str(pair.cert), "client-key": str(pair.key)}
    config = from_kubeconfig(_write(tmp_path / "config", _kubeconfig(user, cluster=cluster)))
    assert config.authorization() is None
    assert (config.cert_path, config.key_path, config.ca_path) == (str(pair.cert), str(pair.key), str(pki.ca.cert))
    assert not config.insecure and config.ssl_context.verify_mode.name == "CERT_REQUIRED"
