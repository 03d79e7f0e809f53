"""Set up Python for a checkout: a shared, cached dependency virtualenv plus a thin local .venv.

Why: torch from PyPI is a CUDA build of several GB. Installing it per clone would make
every clean clone and CI run pay minutes and gigabytes, so the pinned dependencies live
in ``~/.cache/gpuobj/pyenv/<hash of the pins>/`` and are installed once. Each checkout
gets a small ``.venv`` (seconds to create) whose ``.pth`` file points at that shared
site-packages, and an editable install of gpuobj itself. Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import sysconfig
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE_ROOT = Path(os.environ.get("GPUOBJ_CACHE", Path.home() / ".cache" / "gpuobj"))
PYENV_ROOT = CACHE_ROOT / "pyenv"
LOCAL_VENV = REPO / ".venv"
EXTRAS = ("agent", "operator", "test", "observability")
DEPS_PTH = "_gpuobj_shared_deps.pth"
# Folders (besides the checkout itself, for `gpuobj`) that hold one importable package each.
SOURCE_ROOTS = ("contract", "kube", "agent", "operator", "dev")


def pinned_requirements(extras: tuple[str, ...] = EXTRAS) -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return reqs


def deps_key(reqs: list[str]) -> str:
    """Same pins and interpreter -> same cached environment (a pin two extras share counts once)."""
    text = "\n".join(sorted(set(reqs))) + f"\npython={sys.version_info.major}.{sys.version_info.minor}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _check(cmd: list[str], what: str, **kw) -> None:
    print(f"gpuobj setup: {what}", flush=True)
    rc = subprocess.call(cmd, **kw)
    if rc != 0:
        raise SystemExit(f"error: {what} failed (exit {rc}): {' '.join(cmd)}")


def ensure_shared_deps(extras: tuple[str, ...] = EXTRAS) -> Path:
    """Create (once) the cached virtualenv holding the pinned dependencies; return it."""
    reqs = pinned_requirements(extras)
    venv = PYENV_ROOT / deps_key(reqs)
    marker = venv / ".complete"
    if marker.is_file():
        return venv
    started = time.monotonic()
    if venv.exists():  # an earlier install was interrupted
        subprocess.call(["rm", "-rf", str(venv)])
    PYENV_ROOT.mkdir(parents=True, exist_ok=True)
    print(f"gpuobj setup: first run on this machine, installing {len(reqs)} pinned Python packages into {venv}")
    print("gpuobj setup: torch is a multi-GB download; later clones and CI runs reuse this cache", flush=True)
    _check([sys.executable, "-m", "venv", str(venv)], "create the shared virtualenv")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--progress-bar", "on"]
    _check([*pip, *reqs], "install pinned dependencies")
    marker.write_text(f"installed in {time.monotonic() - started:.0f}s\n")
    print(f"gpuobj setup: dependencies installed in {time.monotonic() - started:.0f}s", flush=True)
    return venv


def ensure_local_venv(shared: Path) -> Path:
    """A per-checkout .venv that sees the shared dependencies and this checkout's sources.

    The .pth file does what an editable install would (put gpuobj, gpuobj_contract, gpuobj_kube,
    gpuobj_agent, gpuobj_operator and the dev tooling gpuobj_dev on sys.path) without building
    anything; the `gpuobj` script is the console entry point pyproject.toml declares for real
    installs, and `gpuobj-dev` the developer tools' (checkout only).
    """
    python = LOCAL_VENV / "bin" / "python"
    if not python.exists():
        _check([sys.executable, "-m", "venv", "--without-pip", str(LOCAL_VENV)], f"create {LOCAL_VENV}")
    paths = [_site_packages(shared), REPO, *(REPO / room for room in SOURCE_ROOTS)]
    (_site_packages(LOCAL_VENV) / DEPS_PTH).write_text("".join(f"{p}\n" for p in paths))
    for name, module in (("gpuobj", "gpuobj.cli"), ("gpuobj-dev", "gpuobj_dev.cli")):
        script = LOCAL_VENV / "bin" / name
        script.write_text(f"#!{python}\nimport sys\nfrom {module} import main\nsys.exit(main())\n")
        script.chmod(0o755)
    for tool in ("pytest", "ruff"):  # handy in a shell that activated .venv
        link = LOCAL_VENV / "bin" / tool
        if not link.exists():
            link.symlink_to(shared / "bin" / tool)
    return LOCAL_VENV


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m gpuobj_dev.pyenv", description=__doc__.splitlines()[0])
    parser.add_argument("--print-shared", action="store_true", help="print the shared virtualenv path and exit")
    args = parser.parse_args(argv)
    if sys.version_info < (3, 11):  # noqa: UP036 - runs under whatever python3 the machine has
        raise SystemExit(f"error: gpuobj needs Python 3.11+, this is {sysconfig.get_python_version()}")
    shared = ensure_shared_deps()
    if args.print_shared:
        print(shared)
        return 0
    ensure_local_venv(shared)
    return 0


if __name__ == "__main__":
    sys.exit(main())
