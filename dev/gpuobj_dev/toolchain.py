"""Build the Kubernetes control plane and companion tools from the Go module proxy.

Why: there is no cluster, Docker engine or binary download site on a dev or CI
machine, but the Go module proxy is reachable. Each tool is built once with an
ordinary ``go build`` inside a small generated module that pins it, and cached
under ``~/.cache/gpuobj/toolchain/<tool>-<version>/bin`` so that clean clones
and CI runs reuse it. Standard library only: this runs before the virtualenv.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

VERSIONS_FILE = Path(__file__).with_name("versions.toml")
CACHE_ROOT = Path(os.environ.get("GPUOBJ_CACHE", Path.home() / ".cache" / "gpuobj"))
TOOLCHAIN_ROOT = CACHE_ROOT / "toolchain"

# Binaries each feature needs; `ensure` builds only what is asked for.
ALL_TOOLS = ("etcd", "kubernetes", "helm", "prometheus")
# The dev node adds a container runtime (`ensure containerd`); the control plane never needs it.
NODE_TOOLS = ("containerd", "cri-tools")


class ToolchainError(RuntimeError):
    """A tool could not be built; the message says what to do."""


@dataclass(frozen=True)
class Tool:
    """One pinned Go module and the main packages built from it."""

    name: str
    module: str
    version: str
    packages: tuple[str, ...]
    binary_names: tuple[str, ...]
    extra: dict

    @property
    def home(self) -> Path:
        recipe = int(self.extra.get("recipe", 1))
        return TOOLCHAIN_ROOT / (f"{self.name}-{self.version}" + (f"-r{recipe}" if recipe > 1 else ""))

    @property
    def bin_dir(self) -> Path:
        return self.home / "bin"

    def binaries(self) -> dict[str, Path]:
        return {b: self.bin_dir / b for b in self.binary_names}

    def is_built(self) -> bool:
        return all(p.is_file() and os.access(p, os.X_OK) for p in self.binaries().values())


def load_tools(path: Path = VERSIONS_FILE) -> dict[str, Tool]:
    """Read versions.toml into Tool records."""
    data = tomllib.loads(path.read_text())
    tools = {}
    for name, spec in data.items():
        packages = tuple(spec["packages"])
        names = spec.get("binary_names") or [p.rsplit("/", 1)[-1] for p in packages]
        extra = {k: v for k, v in spec.items() if k not in {"module", "version", "packages", "binary_names"}}
        tools[name] = Tool(name, spec["module"], spec["version"], packages, tuple(names), extra)
    return tools


def binary(name: str) -> Path:
    """Path of a cached binary (kubectl, helm, etcd, promtool, ...), building it if needed."""
    for tool in load_tools().values():
        if name in tool.binary_names:
            if not tool.is_built():
                ensure([tool.name])
            return tool.bin_dir / name
    raise ToolchainError(f"unknown binary {name!r}; known: {sorted(all_binary_names())}")


def all_binary_names() -> list[str]:
    return [b for t in load_tools().values() for b in t.binary_names]


def bin_path_entries(names: tuple[str, ...] = ALL_TOOLS) -> list[str]:
    tools = load_tools()
    return [str(tools[n].bin_dir) for n in names]


# ---------------------------------------------------------------- building


def _go() -> str:
    go = shutil.which("go")
    if not go:
        raise ToolchainError(
            "Go is not installed or not on PATH. gpuobj builds kube-apiserver, etcd, kubectl, "
            "helm and prometheus from the Go module proxy; install Go 1.26+ and retry."
        )
    return go


def _go_env(scratch: Path) -> dict[str, str]:
    """Go's build and module caches live in `scratch`, which the caller removes after the build:
    only the binaries are kept (Go's default caches grow to several GB and nothing reuses them)."""
    env = dict(os.environ)
    env.setdefault("GOFLAGS", "-buildvcs=false")
    env["CGO_ENABLED"] = "0"
    env["GOTOOLCHAIN"] = env.get("GOTOOLCHAIN", "local")
    env["GOCACHE"] = str(scratch / "go-build")
    env["GOMODCACHE"] = str(scratch / "go-mod")
    return env


def _remove_scratch(scratch: Path) -> None:
    """The module cache is read-only by design; make it writable, then remove everything."""
    for root, dirs, _files in os.walk(scratch):
        for d in dirs:
            (Path(root) / d).chmod(0o755)
    shutil.rmtree(scratch, ignore_errors=True)


def _run(cmd: list[str], cwd: Path, label: str, env: dict[str, str]) -> str:
    """Run a go command, printing a heartbeat with the package count so long builds show progress."""
    start = time.monotonic()
    lines: list[str] = []
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(15):
            print(f"  ... {label}: {int(time.monotonic() - start)}s, {len(lines)} packages/lines so far", flush=True)

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip())
    rc = proc.wait()
    done.set()
    beat.join(timeout=1)
    if rc != 0:
        tail = "\n".join(lines[-40:])
        raise ToolchainError(f"{label} failed (exit {rc}) running {' '.join(cmd)} in {cwd}:\n{tail}")
    return "\n".join(lines)


def _kubernetes_requires(tool: Tool, workdir: Path, env: dict[str, str]) -> list[str]:
    """k8s.io/kubernetes replaces its staging modules with local paths, which do not apply to us:
    require every one of them at the matching v0.x.y instead."""
    gomod = _module_gomod(tool, workdir, env)
    replaced = set(re.findall(r"^\s*(k8s\.io/[\w.-]+)\s*=>\s*\./staging/", gomod, flags=re.M))
    required = re.findall(r"^\s*(k8s\.io/[\w.-]+) v0\.0\.0\s*$", gomod, flags=re.M)
    # Only what kubernetes requires: the sample-* staging modules are not all published.
    staging = [m for m in required if m in replaced]
    if not staging:
        raise ToolchainError("no staging replaces found in k8s.io/kubernetes go.mod; versions.toml may be wrong")
    return [f"{m}@{tool.extra['staging_version']}" for m in staging]


def _module_gomod(tool: Tool, workdir: Path, env: dict[str, str]) -> str:
    """The go.mod of the pinned module, as the module proxy serves it."""
    out = _run(
        [_go(), "mod", "download", "-json", f"{tool.module}@{tool.version}"],
        workdir,
        f"download {tool.name} go.mod",
        env,
    )
    gomod_path = re.search(r'"GoMod":\s*"([^"]+)"', out)
    if not gomod_path:
        raise ToolchainError(f"could not locate go.mod of {tool.module}@{tool.version}")
    return Path(gomod_path.group(1)).read_text()


def _ldflags(tool: Tool, gomod: str = "") -> str:
    """Stamp versions so `kubectl version`, `helm version` and Prometheus report the real release."""
    if tool.name == "kubernetes":
        v = tool.version
        major, minor = v.lstrip("v").split(".")[:2]
        flags = []
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
            flags += [
                f"-X {pkg}.gitVersion={v}",
                f"-X {pkg}.gitMajor={major}",
                f"-X {pkg}.gitMinor={minor}",
                f"-X {pkg}.gitTreeState=clean",
                f"-X {pkg}.buildDate=1970-01-01T00:00:00Z",
            ]
        return " ".join(["-s", "-w", *flags])
    if tool.name == "helm":
        # Like helm's Makefile: the Kubernetes version `helm template` assumes follows its client-go.
        minor = re.search(r"k8s\.io/client-go v0\.(\d+)\.", gomod)
        k8s = ""
        if minor:
            for pkg in ("helm.sh/helm/v3/pkg/lint/rules", "helm.sh/helm/v3/pkg/chartutil"):
                k8s += f" -X {pkg}.k8sVersionMajor=1 -X {pkg}.k8sVersionMinor={minor.group(1)}"
        return f"-s -w -X helm.sh/helm/v3/internal/version.version={tool.version}{k8s}"
    if tool.name == "containerd":
        return f"-s -w -X {tool.module}/version.Version={tool.version}"
    if tool.name == "prometheus":
        release = tool.extra.get("release", tool.version)
        return f"-s -w -X github.com/prometheus/common/version.Version={release.lstrip('v')}"
    return "-s -w"


def build(tool: Tool, scratch: Path) -> None:
    """Generate a tiny module pinning the tool, then go build its missing main packages into the cache.

    Binaries are built one by one under a temporary name and renamed into place, so a binary added to
    versions.toml later (kubelet next to kube-apiserver) is built alone and an interrupted build
    leaves no half-written file behind."""
    go = _go()
    src = tool.home / "src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(tool.home / "bin.partial", ignore_errors=True)  # left by older recipes
    src.mkdir(parents=True)
    env = _go_env(scratch)
    started = time.monotonic()
    missing = [
        (pkg, name)
        for pkg, name in zip(tool.packages, tool.binary_names, strict=True)
        if not os.access(tool.bin_dir / name, os.X_OK)
    ]
    print(
        f"gpuobj toolchain: building {tool.name} {tool.version} ({', '.join(n for _, n in missing)})"
        " from the Go module proxy",
        flush=True,
    )
    (src / "go.mod").write_text(f"module gpuobj.io/toolchain/{tool.name}\n\ngo 1.26\n")
    # A blank-import file keeps `go mod tidy` from dropping the requirement.
    imports = "\n".join(f'\t_ "{tool.module}/{p}"' if p else f'\t_ "{tool.module}"' for p in tool.packages)
    (src / "tools.go").write_text(f"//go:build tools\n\npackage tools\n\nimport (\n{imports}\n)\n")
    requires = [f"{tool.module}@{tool.version}"]
    if tool.name == "kubernetes":
        requires += _kubernetes_requires(tool, src, env)
    print(f"  resolving {len(requires)} module pins", flush=True)
    _run([go, "get", *requires], src, f"go get {tool.name}", env)
    _run([go, "mod", "tidy", "-e"], src, f"go mod tidy {tool.name}", env)
    gomod = _module_gomod(tool, src, env)
    tool.bin_dir.mkdir(parents=True, exist_ok=True)
    tags = ",".join(tool.extra.get("tags", []))
    for pkg, name in missing:
        target = f"{tool.module}/{pkg}" if pkg else tool.module
        t0 = time.monotonic()
        print(f"  go build {target} -> {name}", flush=True)
        partial = tool.bin_dir / f".{name}.partial"
        cmd = [go, "build", "-v", "-trimpath", "-ldflags", _ldflags(tool, gomod), "-o", str(partial)]
        _run([*cmd, *(["-tags", tags] if tags else []), target], src, f"build {name}", env)
        partial.rename(tool.bin_dir / name)
        print(f"  built {name} in {time.monotonic() - t0:.0f}s", flush=True)
    print(f"gpuobj toolchain: {tool.name} ready in {time.monotonic() - started:.0f}s at {tool.bin_dir}", flush=True)


def ensure(names: list[str] | tuple[str, ...] = ALL_TOOLS) -> dict[str, Path]:
    """Build whatever is missing from the cache; return binary name -> path."""
    tools = load_tools()
    unknown = [n for n in names if n not in tools]
    if unknown:
        raise ToolchainError(f"unknown tools {unknown}; versions.toml defines {sorted(tools)}")
    paths: dict[str, Path] = {}
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="go-scratch-", dir=CACHE_ROOT))
    try:
        for name in names:
            tool = tools[name]
            if not tool.is_built():
                build(tool, scratch)
            paths.update(tool.binaries())
    finally:
        _remove_scratch(scratch)
    return paths


def cache_size_bytes() -> int:
    return sum(p.stat().st_size for p in TOOLCHAIN_ROOT.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpuobj toolchain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_ensure = sub.add_parser("ensure", help="build missing tools into the cache")
    p_ensure.add_argument("tools", nargs="*", default=list(ALL_TOOLS), help=f"of {[*ALL_TOOLS, *NODE_TOOLS]}")
    sub.add_parser("paths", help="print the cached bin directories, one per line")
    sub.add_parser("status", help="show which tools are built")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "ensure":
            ensure(args.tools)
        elif args.cmd == "paths":
            print("\n".join(bin_path_entries()))
        elif args.cmd == "status":
            for tool in load_tools().values():
                state = "built" if tool.is_built() else "missing"
                print(f"{tool.name:12} {tool.version:10} {state:8} {tool.bin_dir}")
    except ToolchainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
