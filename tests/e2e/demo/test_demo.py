"""The main job: `gpuobj demo` runs end to end, proves the dashboard on real Prometheus, leaves nothing running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nixl, pytest.mark.slow]


RUN_TAG = "GPUOBJ_DEMO_TEST_RUN"  # in the demo's environment, and so in every process it starts


def _processes_of_run(run: str) -> dict[int, str]:
    """Live processes started by this test's demo run (they inherit its environment): never another's."""
    tag = f"{RUN_TAG}={run}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if tag not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone, or not ours to read
        found[int(entry.name)] = cmdline[:200]
    return found


def test_quick_demo_runs_end_to_end_and_leaves_nothing_behind(tmp_path: Path) -> None:
    state, out, report = tmp_path / "cluster", tmp_path / "out", tmp_path / "report.json"
    run = uuid.uuid4().hex
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
        env={**os.environ, "PYTHONUNBUFFERED": "1", RUN_TAG: run},
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    lines = proc.stdout
    for step in range(1, 13):
        assert f"[{step:2d}/12]" in lines
    assert "$ kubectl get gpuobj -n gpuobj-demo" in lines
    assert "summary" in lines and "leaked bytes            0" in lines
    r = json.loads(report.read_text())
    assert r["wrong_items"] == 0 and r["weights_ok"]
    assert r["weight_sync_ok"]  # each rollout's logits equal the trainer's, bit for bit, every step
    assert r["leaked_bytes_peak"] > 0 and r["leaked_bytes_end"] == 0  # the planted leak was seen, then reclaimed
    assert r["frees"] > 0 and r["bytes_moved"] > 0
    # Every pod is scraped, the weight-sync pods included: their fetches count in the bytes moved
    # (2 rollouts x 5 versions of the model at least), and each version is timed against its floor.
    assert r["bytes_moved_weight_sync"] >= 10 * r["weight_sync_versions"][0]["bytes"] > 0
    assert len(r["weight_sync_versions"]) == 5 and r["weight_sync_raw_read_s"] > 0
    assert all(v["floor_ratio"] > 0 for v in r["weight_sync_versions"])  # a figure, never a timed assertion
    empty = [name for name, has_data in r["panels"].items() if not has_data]
    assert empty == [], f"dashboard panel queries without data: {empty}"
    assert Path(r["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Ctrl-C-safe teardown: no control plane, operator, agent or Prometheus process survives the demo.
    left = _processes_of_run(run)
    assert left == {}, left
    assert not state.exists()
