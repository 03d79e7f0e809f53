"""Build gpuobj's container images from the project's Dockerfile with buildah, without a registry.

Why: the Dockerfile is what users build against the real registries, but a dev or CI machine has
no Docker engine and cannot pull base images. So this first makes local stand-ins under the exact
names the Dockerfile's FROM lines use (a debootstrapped Debian bookworm: the Python stand-in with
Debian's python3.11 and pip, the CUDA stand-in with no CUDA at all: torch's wheels bring their own
CUDA libraries and run on CPU), then builds the Dockerfile's targets with ``--pull=never``. Images,
layers and the debootstrapped rootfs live under ``~/.cache/gpuobj/images/`` (outside the checkout),
so later builds reuse every unchanged layer. Builds run with the host network (pip and apt reach
their registries) and create no bridge, netns or firewall rule.

Needs root and Debian's buildah, podman, debootstrap (``ensure_host_packages`` installs them).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gpuobj_dev import hostpkgs, toolchain

REPO_ROOT = Path(__file__).resolve().parents[2]
IMAGES_ROOT = toolchain.CACHE_ROOT / "images"
STORAGE_ROOT = IMAGES_ROOT / "storage"
RUN_ROOT = Path("/run/gpuobj-images")
ROOTFS_TAR = IMAGES_ROOT / "bookworm-minbase.tar"
DEBIAN_MIRROR = os.environ.get("GPUOBJ_DEBIAN_MIRROR", "http://deb.debian.org/debian")

# The names the Dockerfile's FROM lines use (its ARG defaults); tests/e2e/node/test_images.py checks they agree.
PYTHON_IMAGE = "docker.io/library/python:3.11.14-slim-bookworm"
CUDA_IMAGE = "docker.io/nvidia/cuda:13.2.0-runtime-ubuntu24.04"
MINBASE_IMAGE = "localhost/gpuobj-standin/bookworm-minbase:12"
# What the dev node runs (charts/gpuobj values point at these with imagePullPolicy Never).
OPERATOR_IMAGE = "localhost/gpuobj-operator:dev"
AGENT_IMAGE = "localhost/gpuobj-agent:dev"
PAUSE_IMAGE = "localhost/gpuobj-pause:dev"
TARGETS = {"operator": OPERATOR_IMAGE, "agent": AGENT_IMAGE}
# podman and buildah need an OCI runtime to run a container (a RUN step, `podman run`); with
# --no-install-recommends apt-get brings none, so runc is named here (the dev node needs it too).
HOST_PACKAGES = ("buildah", "podman", "debootstrap", "skopeo", "uidmap", "runc")
HOST_COMMANDS = ("buildah", "podman", "debootstrap", "skopeo", "/usr/sbin/runc")

STANDIN_LABEL = 'org.opencontainers.image.description="gpuobj dev stand-in for {name}, built locally: {what}"'

PAUSE_GO = """\
// The dev node's sandbox ("pause") process: PID 1 of every pod, holds its namespaces, reaps zombies,
// exits on SIGINT/SIGTERM. Same job as Kubernetes' pause.c, in Go so the toolchain builds it.
package main

import (
\t"os"
\t"os/signal"
\t"syscall"
)

func main() {
\tsigs := make(chan os.Signal, 8)
\tsignal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
\tfor s := range sigs {
\t\tif s != syscall.SIGCHLD {
\t\t\tos.Exit(0)
\t\t}
\t\tfor {
\t\t\tvar ws syscall.WaitStatus
\t\t\tpid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
\t\t\tif pid <= 0 || err != nil {
\t\t\t\tbreak
\t\t\t}
\t\t}
\t}
}
"""


class ImageBuildError(RuntimeError):
    """An image could not be built; the message carries the failing command's output."""


@dataclass
class BuildResult:
    image: str
    seconds: float
    size_bytes: int


def container_env() -> dict[str, str]:
    """Environment pointing buildah/podman/skopeo at the cached store (never the system's)."""
    IMAGES_ROOT.mkdir(parents=True, exist_ok=True)
    storage_conf = IMAGES_ROOT / "storage.conf"
    storage_conf.write_text(f'[storage]\ndriver = "overlay"\nrunroot = "{RUN_ROOT}"\ngraphroot = "{STORAGE_ROOT}"\n')
    # podman's default nofile/nproc limits (1048576) can be above what this process may grant
    # (no CAP_SYS_RESOURCE in some sandboxes): containers get ours.
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 16384)
    # (measured in this sandbox: runc is refused RLIMIT_NPROC above 32768 even under the hard limit.)
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
    # runc, not crun: Debian's crun 1.8 refuses cgroups v1 hybrid hosts ("cgroups in hybrid mode not supported").
    containers_conf = IMAGES_ROOT / "containers.conf"
    containers_conf.write_text(
        "[containers]\n"
        'netns = "host"\n'
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n\n'
        "[engine]\n"
        'cgroup_manager = "cgroupfs"\n'
        'events_logger = "file"\n'
        'runtime = "runc"\n\n'
        "[network]\n"
        'network_backend = "cni"\n'
    )
    env = dict(os.environ)
    env.update(
        CONTAINERS_STORAGE_CONF=str(storage_conf),
        CONTAINERS_CONF=str(containers_conf),
        BUILDAH_ISOLATION="oci",
        BUILDAH_LAYERS="true",
    )
    return env


def _run(cmd: list[str], *, label: str, capture: bool = False, cwd: Path | None = None) -> str:
    """Run a build command, streaming its output (builds are long) unless captured."""
    proc = subprocess.run(
        cmd,
        env=container_env(),
        cwd=cwd,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.STDOUT if capture else None,
        text=True,
    )
    if proc.returncode != 0:
        out = (proc.stdout or "")[-4000:] if capture else "(output above)"
        raise ImageBuildError(f"{label} failed (exit {proc.returncode}): {' '.join(cmd)}\n{out}")
    return proc.stdout or ""


def podman(*args: str, capture: bool = True) -> str:
    return _run(["podman", *args], label=f"podman {args[0]}", capture=capture)


def image_exists(name: str) -> bool:
    return subprocess.run(["podman", "image", "exists", name], env=container_env()).returncode == 0


def image_size(name: str) -> int:
    return int(podman("image", "inspect", "--format", "{{.Size}}", name).strip())


def check_host() -> str | None:
    """Why this host cannot build images, or None when it can."""
    if os.geteuid() != 0:
        return "building images here needs root (buildah with overlay storage and debootstrap)"
    return None


def ensure_host_packages() -> None:
    hostpkgs.ensure(HOST_PACKAGES, commands=HOST_COMMANDS)


# ---------------------------------------------------------------- stand-in bases


def _debootstrap() -> None:
    """A bookworm minbase rootfs tarball, cached: the root of both stand-ins."""
    if ROOTFS_TAR.is_file():
        return
    print(f"images: debootstrap bookworm minbase from {DEBIAN_MIRROR} (once; cached at {ROOTFS_TAR})", flush=True)
    IMAGES_ROOT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=IMAGES_ROOT, prefix="rootfs.") as tmp:
        root = Path(tmp) / "rootfs"
        _run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=passwd,ca-certificates",
                "bookworm",
                str(root),
                DEBIAN_MIRROR,
            ],
            label="debootstrap",
            capture=True,
        )
        _add_host_trust(root)
        # Like the official images: no apt caches, no logs.
        shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
        (root / "var/cache/apt/archives/partial").mkdir(parents=True)
        shutil.rmtree(root / "var/lib/apt/lists", ignore_errors=True)
        (root / "var/lib/apt/lists/partial").mkdir(parents=True)
        partial = ROOTFS_TAR.with_suffix(".partial")
        subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."], check=True)
        partial.rename(ROOTFS_TAR)


def _add_host_trust(root: Path) -> None:
    """This machine's extra CA certificates and pip.conf, so pip and apt inside a build reach their
    registries the way the host does (through a TLS-inspecting egress proxy, where there is one)."""
    extra = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
    if extra:
        dest = root / "usr/local/share/ca-certificates"
        dest.mkdir(parents=True, exist_ok=True)
        for cert in extra:
            shutil.copy2(cert, dest / cert.name)
        _run(["chroot", str(root), "update-ca-certificates"], label="update-ca-certificates", capture=True)
    if Path("/etc/pip.conf").is_file():
        shutil.copy2("/etc/pip.conf", root / "etc/pip.conf")


def _build_containerfile(text: str, tag: str) -> None:
    with tempfile.TemporaryDirectory(prefix="gpuobj-standin.") as ctx:
        (Path(ctx) / "Containerfile").write_text(text)
        _run(
            ["buildah", "bud", "--pull=never", "--network=host", "--layers", "-t", tag, "-f", "Containerfile", ctx],
            label=f"build {tag}",
            capture=True,
        )


def ensure_standins() -> None:
    """The Dockerfile's base images, built locally under their real names (never pulled)."""
    _debootstrap()
    if not image_exists(MINBASE_IMAGE):
        podman(
            "import",
            "--change",
            "ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--change",
            "CMD=/bin/bash",
            str(ROOTFS_TAR),
            MINBASE_IMAGE,
        )
    if not image_exists(CUDA_IMAGE):
        # No CUDA: the agent's torch wheel brings its CUDA libraries and runs on CPU; the Dockerfile
        # installs python3 with apt-get, as it does on the real Ubuntu base.
        label = STANDIN_LABEL.format(name=CUDA_IMAGE, what="Debian bookworm minbase, no CUDA")
        _build_containerfile(f"FROM {MINBASE_IMAGE}\nLABEL {label}\n", CUDA_IMAGE)
    if not image_exists(PYTHON_IMAGE):
        label = STANDIN_LABEL.format(name=PYTHON_IMAGE, what="Debian bookworm with Debian's python3.11 and pip")
        _build_containerfile(
            f"FROM {MINBASE_IMAGE}\n"
            "RUN apt-get update \\\n"
            " && DEBIAN_FRONTEND=noninteractive apt-get install --yes --no-install-recommends \\\n"
            "      python3 python3-venv python3-pip python-is-python3 \\\n"
            " && rm -rf /var/lib/apt/lists/* /usr/lib/python3.11/EXTERNALLY-MANAGED\n"
            f"LABEL {label}\n",
            PYTHON_IMAGE,
        )


def ensure_pause() -> None:
    """The sandbox image of the dev node: one static Go binary, FROM scratch."""
    if image_exists(PAUSE_IMAGE):
        return
    with tempfile.TemporaryDirectory(prefix="gpuobj-pause.") as ctx:
        (Path(ctx) / "pause.go").write_text(PAUSE_GO)
        env = dict(os.environ, CGO_ENABLED="0", GOTOOLCHAIN="local", GOFLAGS="-buildvcs=false")
        subprocess.run(
            [shutil.which("go") or "go", "build", "-trimpath", "-ldflags=-s -w", "-o", "pause", "pause.go"],
            cwd=ctx,
            env=env,
            check=True,
        )
        (Path(ctx) / "Containerfile").write_text(
            'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n'
        )
        _run(
            ["buildah", "bud", "--pull=never", "--network=none", "-t", PAUSE_IMAGE, "-f", "Containerfile", ctx],
            label="build pause",
            capture=True,
        )


# ---------------------------------------------------------------- the Dockerfile's targets


# Stages each target is built from; their results are tagged so that pruning keeps exactly one cached
# chain per stage (an untagged stage would be pruned with its layers). The agent's dependencies
# (`agent-deps`, from pyproject.toml alone) and the runtime that copies them (`agent-runtime`) stay
# cached across source changes: a source change rebuilds the wheel and `agent-app` (megabytes), not the
# 6 GB of torch.
CACHE_STAGES = {
    "operator": ("builder",),
    "agent": ("builder", "agent-requirements", "agent-deps", "agent-runtime", "agent-app"),
}
# What the Dockerfile's build context holds (.dockerignore lets only these in).
CONTEXT = ("pyproject.toml", "README.md", "gpuobj", "contract", "kube", "agent", "operator")


def context_digest() -> str:
    """sha256 of the Dockerfile and the files of the build context: when it is unchanged, so are the images."""
    h = hashlib.sha256((REPO_ROOT / "Dockerfile").read_bytes())
    for entry in CONTEXT:
        root = REPO_ROOT / entry
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            rel = path.relative_to(REPO_ROOT)
            if "__pycache__" in rel.parts or path.suffix == ".pyc" or any(".egg-info" in x for x in rel.parts):
                continue
            h.update(str(rel).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _bud(target: str, tag: str, quiet: bool) -> None:
    _run(
        [
            "buildah",
            "bud",
            "--pull=never",
            "--network=host",
            "--layers",
            # Docker's format keeps the Dockerfile's HEALTHCHECK (OCI has no field for it).
            "--format=docker",
            "--target",
            target,
            "-t",
            tag,
            "-f",
            str(REPO_ROOT / "Dockerfile"),
            str(REPO_ROOT),
        ],
        label=f"build {target}",
        capture=quiet,
    )


def build_target(target: str, *, quiet: bool = False) -> BuildResult:
    """`buildah bud --target <target> --pull=never` of the project's Dockerfile, reusing cached layers.

    Skipped when the image was built from the same context (digest recorded next to the store). When the
    context changed, the stages are rebuilt over their tagged caches (unchanged steps are cache hits), and
    what the new chain no longer uses is pruned afterwards, so the store holds one chain per stage."""
    ensure_standins()
    tag = TARGETS[target]
    started = time.monotonic()
    digest = context_digest()
    marker = IMAGES_ROOT / f"{target}.context"
    if image_exists(tag) and marker.is_file() and marker.read_text() == digest:
        return BuildResult(tag, time.monotonic() - started, image_size(tag))
    marker.unlink(missing_ok=True)
    subprocess.run(["buildah", "rm", "--all"], env=container_env(), capture_output=True)
    for stage in CACHE_STAGES[target]:
        _bud(stage, f"localhost/gpuobj-build/{stage}:cache", quiet)
    _bud(target, tag, quiet)
    # Dangling chains of earlier builds (changed sources): keep the store bounded.
    subprocess.run(["buildah", "rmi", "--prune"], env=container_env(), capture_output=True)
    marker.write_text(digest)
    return BuildResult(tag, time.monotonic() - started, image_size(tag))


def ensure(targets: list[str] | tuple[str, ...] = ("operator", "agent"), *, quiet: bool = False) -> list[BuildResult]:
    """Build the stand-ins, the pause image and the given targets (cached layers make rebuilds fast)."""
    reason = check_host()
    if reason:
        raise ImageBuildError(reason)
    ensure_host_packages()
    ensure_standins()
    ensure_pause()
    return [build_target(t, quiet=quiet) for t in targets]


def save_oci_archive(image: str, dest: Path) -> Path:
    """The image as an OCI archive (what containerd imports)."""
    dest.unlink(missing_ok=True)
    podman("save", "--format", "oci-archive", "-o", str(dest), image)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpuobj-dev images", description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", default=["operator", "agent"], help=f"of {sorted(TARGETS)}")
    parser.add_argument(
        "--when-possible",
        action="store_true",
        help="on a host that cannot build images (not root), say why and succeed: `make test` builds them as a "
        "step of its own before pytest, so the real-node tests never spend their time limit on a first build",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.targets) - set(TARGETS))
    if unknown:
        parser.error(f"unknown targets {unknown}; the Dockerfile's are {sorted(TARGETS)}")
    reason = check_host()
    if reason and args.when_possible:
        print(f"gpuobj images: not built ({reason}); the tests that need them skip with that reason")
        return 0
    started = time.monotonic()
    try:
        for result in ensure(args.targets):
            print(f"{result.image}: {result.size_bytes / 2**20:.0f} MiB, built in {result.seconds:.0f}s")
    except ImageBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"gpuobj images: ready in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
