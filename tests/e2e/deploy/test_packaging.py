"""What a workload or an image installs: the wheel built from this repo, and its extras per audience.

Builds the real wheel (pip, setuptools from pyproject.toml) and reads it back: no dev tooling, no
tests, and dependencies split so the operator's install carries no data plane.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from gpuobj_dev.testing.cluster import REPO

SHIPPED = {"gpuobj", "gpuobj_contract", "gpuobj_kube", "gpuobj_agent", "gpuobj_operator"}
DATA_PLANE = {"torch", "nixl", "numpy"}  # cryptography: the operator signs agent certificates (agent_ca.py)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy of what the Dockerfile's build context holds (.dockerignore), as an image build
    would: setuptools writes build/ and *.egg-info next to the sources, so never in the checkout."""
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("context")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in ("gpuobj", "contract", "kube", "agent", "operator"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = out.glob("gpuobj-*.whl")
    return whl


def _requirements(whl: Path) -> dict[str | None, set[str]]:
    """Requires-Dist by extra (None: the base install), as bare package names."""
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode())
    by_extra: dict[str | None, set[str]] = {}
    for req in msg.get_all("Requires-Dist") or []:
        name = req.split(";")[0].split("=")[0].split("<")[0].split(">")[0].split("[")[0].strip().lower()
        extra = req.split("extra ==")[1].strip().strip("'\"") if "extra ==" in req else None
        by_extra.setdefault(extra, set()).add(name)
    return by_extra


def test_the_wheel_ships_the_product_and_no_dev_tooling(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        tops = {n.split("/")[0] for n in z.namelist() if not n.split("/")[0].endswith(".dist-info")}
        files = z.namelist()
    assert tops == SHIPPED
    assert not [f for f in files if "gpuobj_dev" in f or f.startswith("tests/") or "testing" in f]


def test_extras_split_the_dependencies_by_audience(wheel: Path) -> None:
    reqs = _requirements(wheel)
    assert not reqs[None] & DATA_PLANE, "the base install must not pull the data plane"
    assert "cryptography" in reqs["operator"] and not reqs["operator"] & DATA_PLANE
    assert {"torch", "nixl", "numpy"} <= reqs["agent"]
    assert {"aiohttp", "kubernetes"} <= reqs[None]  # the one watch stack (gpuobj_kube) and its credentials


def test_the_dockerfile_installs_extras_not_a_filtered_list() -> None:
    """The operator installs the wheel's extra; the agent installs its extra's list by name (read from
    pyproject.toml alone, so torch's layer survives source changes), then the wheel without dependencies."""
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "[operator]" in dockerfile
    assert "p['dependencies'] + p['optional-dependencies']['agent']" in dockerfile
    assert "--no-deps --target /opt/gpuobj-app" in dockerfile
    assert "re.split" not in dockerfile and "re.match" not in dockerfile
