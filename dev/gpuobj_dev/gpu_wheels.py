"""Fill .gpu-wheels/ with what the GPU machine's image lacks, and check it travels within the limit (issue 33).

The image has Python 3.12, torch (cu130), aiohttp, prometheus-client, pytest and, as torch's images do, numpy;
it lacks NIXL, PyJWT and cryptography. The versions are the `agent` extra's pins in pyproject.toml; `nixl` is
its small meta package (the `nixl` module, which picks the CUDA backend) and `nixl-cu13` the backend it picks
for torch's CUDA 13 (the meta package's own dependencies, nixl-cu12 too, are not wanted: dev/gpu_check.sh
installs with --no-deps). cffi is cryptography's one binary dependency. What travels to the machine, the
working tree plus carried folders, must stay within 64 MiB; numpy (16 MiB) is carried only on request.

Usage: python -m gpuobj_dev.gpu_wheels [--dest .gpu-wheels] [--numpy]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIMIT = 64 << 20  # what the device tool carries: the working tree and the carried paths together
CFFI = "cffi==2.0.0"  # cryptography's binary dependency (not pinned in pyproject: it comes with cryptography)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def wanted(numpy: bool) -> list[str]:
    """The pins from pyproject's `agent` extra the image lacks, plus the CUDA 13 NIXL backend and cffi."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["agent"]
    pins = {req.split("==")[0]: req for req in extra}
    nixl_version = pins["nixl"].split("==")[1]
    out = [pins["nixl"], f"nixl-cu13=={nixl_version}", pins["pyjwt"], pins["cryptography"], CFFI]
    return [*out, pins["numpy"]] if numpy else out


def tree_bytes() -> int:
    """Bytes of what travels besides the carried paths: tracked files and untracked files git does not ignore."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum((REPO / n.decode()).stat().st_size for n in names if n and (REPO / n.decode()).is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dest", type=Path, default=REPO / ".gpu-wheels")
    parser.add_argument("--numpy", action="store_true", help="carry numpy too (over the limit with NIXL)")
    args = parser.parse_args(argv)
    shutil.rmtree(args.dest, ignore_errors=True)
    args.dest.mkdir(parents=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--no-deps"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", *platforms, "--dest", str(args.dest)]
    subprocess.run([*cmd, *wanted(args.numpy)], check=True)
    wheels = sorted(args.dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    tree = tree_bytes()
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
    print(f"{total / 2**20:8.2f} MiB  wheels in {args.dest} ({total} B)")
    print(f"{tree / 2**20:8.2f} MiB  the working tree (tracked and untracked, not ignored)")
    print(f"{(total + tree) / 2**20:8.2f} MiB  together; the limit is {LIMIT / 2**20:.0f} MiB")
    if total + tree > LIMIT:
        print("gpu-wheels: over the limit: the device tool will not carry this folder", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
