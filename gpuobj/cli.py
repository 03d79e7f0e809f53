"""The `gpuobj` command line: what a workload or an image runs (a standalone agent, the operator).

Subcommands import their part lazily so that `gpuobj operator` does not pay for importing
torch and NIXL. Developer tools (dev control plane, demo) are `gpuobj-dev`, in a checkout only.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with `main(argv) -> int`, help)
DELEGATED = {
    "agent": ("gpuobj_agent.main", "run a standalone gpuobj agent (object store, NIXL, control server)"),
    "operator": ("gpuobj_operator.main", "run the gpuobj operator"),
}


def add_delegated(sub: argparse._SubParsersAction[argparse.ArgumentParser], table: dict[str, tuple[str, str]]) -> None:
    """Subcommands whose module parses its own arguments (listed in --help, imported only when run)."""
    for name, (_, help_text) in table.items():
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)


def run_delegated(table: dict[str, tuple[str, str]], argv: list[str]) -> int | None:
    """Run argv's subcommand if the table has it (its module's `main(argv) -> int`), else None."""
    if argv and argv[0] in table:
        module = importlib.import_module(table[argv[0]][0])
        return int(module.main(argv[1:]) or 0)
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuobj", description="GPU tensor objects shared between Kubernetes pods")
    add_delegated(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"), DELEGATED)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rc = run_delegated(DELEGATED, argv)
    if rc is not None:
        return rc
    build_parser().parse_args(argv)  # prints usage and exits for anything else
    return 2


if __name__ == "__main__":
    sys.exit(main())
