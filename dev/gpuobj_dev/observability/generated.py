"""Committed, generated files: write them, or check that the committed copy matches the code.

Why: the dashboard JSON and the rules YAML are reviewed and shipped as files (Grafana
sidecar, PrometheusRule), but written by code; ``--check`` in a test keeps the two equal.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def main(prog: str, description: str, render: Callable[[], str], output: Path, argv: list[str] | None = None) -> int:
    """CLI shared by the generators: --write, --check (exit 1 when stale) or --print."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help=f"write {output}")
    mode.add_argument("--check", action="store_true", help="exit 1 if the committed file differs from the code")
    mode.add_argument("--print", action="store_true", help="print the generated text to stdout")
    parser.add_argument("--output", type=Path, default=output)
    args = parser.parse_args(argv)
    text = render()
    if args.print:
        sys.stdout.write(text)
        return 0
    if args.write:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
        print(f"wrote {args.output}")
        return 0
    current = args.output.read_text() if args.output.is_file() else ""
    if current != text:
        print(f"{args.output} is out of date: regenerate it with `{prog} --write`", file=sys.stderr)
        return 1
    print(f"{args.output} is up to date")
    return 0
