"""Set up Python for a checkout: a shared, cached dependency virtualenv plus a thin local .venv.

Why: torch from PyPI is a CUDA build of several GB. Installing it per clone would make
every clean clone and CI run pay minutes and gigabytes, so the pinned dependencies live
in ``~/.cache/gpuobj/pyenv/<hash of the pins>/`` and are installed once. Each checkout
gets a small ``.venv`` (seconds to create) whose ``.pth`` file points at that shared
site-packages, and an editable install of gpuobj itself. Standard library only.

An environment is keyed on the pins, so a pin change makes a new one (~6 GB) and would leave the old
one behind for good. Each set-up notes when it used its environment, and removes the others that no
checkout is likely to need again (``prune_environments``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
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
LAST_USED = ".last-used"  # touched by every set-up that uses the environment
# Kept besides the environment in use: the most recently used other one (a checkout of another branch
# switches back), and any used within this long (another checkout may be running tests with it now).
KEEP_OTHERS = 1
KEEP_USED_WITHIN_S = 6 * 3600.0
LOCK_WAIT_S = 1800.0  # a first install on a slow network takes minutes; beyond this, say so and stop


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


@contextlib.contextmanager
def _exclusive(root: Path = PYENV_ROOT):
    """One set-up at a time per machine: a second one (another clone, CI) waits here rather than take
    the first one's half-made environment for an interrupted install and remove it."""
    root.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + LOCK_WAIT_S
    said = False
    with open(root / ".lock", "w") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SystemExit(
                        f"error: another gpuobj set-up held {root / '.lock'} for {LOCK_WAIT_S:.0f}s"
                    ) from None
                if not said:
                    print("gpuobj setup: another set-up is installing the shared environment; waiting", flush=True)
                    said = True
                time.sleep(1.0)
        yield


def ensure_shared_deps(extras: tuple[str, ...] = EXTRAS) -> Path:
    """Create (once) the cached virtualenv holding the pinned dependencies; return it."""
    with _exclusive():
        return _ensure_shared_deps(extras)


def _ensure_shared_deps(extras: tuple[str, ...]) -> Path:
    reqs = pinned_requirements(extras)
    venv = PYENV_ROOT / deps_key(reqs)
    marker = venv / ".complete"
    if marker.is_file():
        (venv / LAST_USED).touch()
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
    (venv / LAST_USED).touch()
    print(f"gpuobj setup: dependencies installed in {time.monotonic() - started:.0f}s", flush=True)
    return venv


def last_used(venv: Path) -> float:
    """When a set-up last used ``venv`` (its install, for environments made before the marker existed)."""
    for marker in (LAST_USED, ".complete"):
        if (venv / marker).exists():
            return (venv / marker).stat().st_mtime
    return venv.stat().st_mtime  # an install that never finished


def prunable(environments: dict[Path, float], in_use: Path, now: float) -> list[Path]:
    """Which of ``environments`` (path -> last used) to remove: all but the one in use, the
    ``KEEP_OTHERS`` most recently used others, and any used within ``KEEP_USED_WITHIN_S``."""
    others = sorted((p for p in environments if p != in_use), key=lambda p: environments[p], reverse=True)
    return [p for p in others[KEEP_OTHERS:] if now - environments[p] > KEEP_USED_WITHIN_S]


def _size_gb(path: Path) -> float:
    total = sum(f.lstat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    return total / 1e9


def prune_environments(in_use: Path, root: Path = PYENV_ROOT) -> list[Path]:
    """Remove the cached environments ``prunable`` names, saying what each freed."""
    environments = {p: last_used(p) for p in root.iterdir() if p.is_dir()}
    now = time.time()
    removed = prunable(environments, in_use, now)
    for venv in removed:
        idle_days = (now - environments[venv]) / 86400
        size = _size_gb(venv)
        shutil.rmtree(venv, ignore_errors=True)
        print(
            f"gpuobj setup: removed the unused environment {venv} ({size:.1f} GB, last used {idle_days:.1f} days ago)"
        )
    return removed


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
    with _exclusive():
        prune_environments(shared)
    if args.print_shared:
        print(shared)
        return 0
    ensure_local_venv(shared)
    return 0


if __name__ == "__main__":
    sys.exit(main())
