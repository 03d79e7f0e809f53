"""The main job: `gpuobj demo` runs end to end, proves the dashboard on real Prometheus, leaves nothing running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nixl, pytest.mark.slow]


SUSPECTS = ("gpuobj", "prometheus", "etcd", "kube-apiserver", "kube-controller-manager", "GPUOBJ_POD_NAME")


def _our_kind_of_processes() -> dict[int, str]:
    """Processes that look like something the demo starts: control plane, operator, workloads, Prometheus."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if (entry / "stat").read_text().split()[2] == "Z":
                continue
        except OSError:
            continue
        if any(s in cmdline for s in SUSPECTS):
            found[int(entry.name)] = cmdline[:200]
    return found


def test_quick_demo_runs_end_to_end_and_leaves_nothing_behind(tmp_path: Path) -> None:
    state, out, report = tmp_path / "cluster", tmp_path / "out", tmp_path / "report.json"
    before = _our_kind_of_processes()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuobj_dev.cli",
            "demo",
            "--quick",
            "--state-dir",
            str(state),
            "--out",
            str(out),
            "--report",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    lines = proc.stdout
    for step in range(1, 12):
        assert f"[{step:2d}/11]" in lines
    assert "$ kubectl get gpuobj -n gpuobj-demo" in lines
    assert "summary" in lines and "leaked bytes            0" in lines
    r = json.loads(report.read_text())
    assert r["wrong_items"] == 0 and r["weights_ok"]
    assert r["leaked_bytes_peak"] > 0 and r["leaked_bytes_end"] == 0  # the planted leak was seen, then reclaimed
    assert r["frees"] > 0 and r["bytes_moved"] > 0
    empty = [name for name, has_data in r["panels"].items() if not has_data]
    assert empty == [], f"dashboard panel queries without data: {empty}"
    assert Path(r["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Ctrl-C-safe teardown: no control plane, operator, agent or Prometheus process survives the demo.
    left = {pid: cmd for pid, cmd in _our_kind_of_processes().items() if pid not in before}
    assert left == {}, left
    assert not state.exists()
