"""The `gpuobj-dev` command line: developer tools that never ship (dev control plane, demo, toolchain).

Why separate from `gpuobj`: what a workload or an image installs must not carry the Go
toolchain builder, the dev PKI or the demo; this entry point exists only in a checkout's .venv.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpuobj.cli import add_delegated, run_delegated

# subcommand -> (module with `main(argv) -> int`, help)
DELEGATED = {
    "demo": ("gpuobj_dev.demo.main", "run the end-to-end demo on the dev control plane"),
    "toolchain": ("gpuobj_dev.toolchain", "build or locate the cached control-plane binaries"),
}


def _dev_cluster(args: argparse.Namespace) -> int:
    from gpuobj_dev.cluster import DevCluster, DevClusterError

    cluster = DevCluster(Path(args.state_dir))
    try:
        if args.action == "up":
            state = cluster.up(timeout=args.timeout)
            env = cluster.env()
            print(f"kubeconfig: {cluster.kubeconfig}")
            print(f"logs:       {cluster.logs}/{{etcd,kube-apiserver,kube-controller-manager}}.log")
            print("use it:")
            print(f'  eval "$(gpuobj-dev dev-cluster env)"   # or: export KUBECONFIG={env["KUBECONFIG"]}')
            print("  kubectl get ns")
            print(f"stop it:    gpuobj-dev dev-cluster down   (API server {state.server})")
        elif args.action == "down":
            cluster.down()
        elif args.action == "status":
            print("\n".join(cluster.status_lines()))
            return 0 if cluster.running() else 3
        elif args.action == "env":
            if not cluster.load_state():
                print("error: dev cluster is not running; start it with `gpuobj-dev dev-cluster up`", file=sys.stderr)
                return 3
            for key, value in cluster.env().items():
                print(f"export {key}={value}")
    except DevClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    from gpuobj_dev.cluster import DEFAULT_STATE_DIR

    parser = argparse.ArgumentParser(
        prog="gpuobj-dev", description="gpuobj developer tools: dev control plane, demo, toolchain"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dev = sub.add_parser(
        "dev-cluster", help="a real control plane (etcd, kube-apiserver, kube-controller-manager) on loopback"
    )
    dev.add_argument("action", choices=["up", "down", "status", "env"])
    dev.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR), help="where certificates, data and logs live")
    dev.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each component to become ready")
    dev.set_defaults(func=_dev_cluster)
    add_delegated(sub, DELEGATED)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rc = run_delegated(DELEGATED, argv)
    if rc is not None:
        return rc
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
