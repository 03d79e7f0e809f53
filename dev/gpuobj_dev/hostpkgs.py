"""Install the Debian packages the dev node and the image builds need, once, with apt-get.

Why: a fresh CI machine has Go and Python but not buildah, podman, runc, crun or the CNI plugins;
`make test` must set them up itself, like it builds the control plane. Only missing commands
trigger apt-get; without root or apt-get the caller gets a clear reason instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


class HostPackageError(RuntimeError):
    """Packages are missing and could not be installed; the message says which and why."""


def _present(command: str) -> bool:
    return Path(command).exists() if command.startswith("/") else shutil.which(command) is not None


def missing(commands: tuple[str, ...]) -> list[str]:
    return [c for c in commands if not _present(c)]


def ensure(packages: tuple[str, ...], *, commands: tuple[str, ...]) -> None:
    """apt-get install `packages` unless every one of `commands` (names or absolute paths) is present."""
    absent = missing(commands)
    if not absent:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise HostPackageError(
            f"missing {absent}; install the Debian packages {list(packages)} (needs root and apt-get)"
        )
    print(f"host packages: apt-get install {' '.join(packages)} (missing {absent})", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
    ):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise HostPackageError(
                f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
    still = missing(commands)
    if still:
        raise HostPackageError(f"apt-get installed {list(packages)} but {still} are still missing")
