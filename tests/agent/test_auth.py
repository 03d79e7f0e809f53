"""Bearer tokens from a file: constant-time checks, rotation without restart, no open API."""

from __future__ import annotations

import os

import pytest

from gpuobj_agent.auth import TokenError, TokenFile
from gpuobj_agent.main import main
from gpuobj_dev.testing.waits import wait_until


def test_only_the_current_bearer_token_is_accepted(tmp_path):
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    tokens = TokenFile(str(path))
    assert tokens.check("Bearer s3cret") and tokens.check("bearer s3cret")
    for header in (None, "", "Bearer", "Bearer ", "Basic s3cret", "Bearer s3cret2", "s3cret", "Bearer S3CRET"):
        assert not tokens.check(header), header


def test_a_rotated_secret_takes_effect_without_a_restart(tmp_path, monkeypatch):
    monkeypatch.setattr(TokenFile, "RECHECK_SECONDS", 0.0)
    path = tmp_path / "token"
    path.write_text("old")
    tokens = TokenFile(str(path))
    path.write_text("new")
    os.utime(path, ns=(1, 1))  # a different mtime, as the kubelet's atomic swap gives
    wait_until(lambda: tokens.check("Bearer new"), "the new token to be read")
    assert not tokens.check("Bearer old")
    path.write_text("")  # mid-rotation: an empty file keeps the last good token
    os.utime(path, ns=(2, 2))
    assert tokens.check("Bearer new")


@pytest.mark.parametrize("content", [None, "", "   \n"])
def test_an_agent_without_a_usable_token_refuses_to_start(tmp_path, capsys, content):
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TokenError):
        TokenFile(str(path))
    assert main(["--pod-name", "p", "--port", "0", "--host", "127.0.0.1", "--token-file", str(path)]) == 2
    assert "token file" in capsys.readouterr().err
