"""
The ``llmgw`` console script.

``llmgw ctl ...`` is the operator CLI; ``llmgw local`` is a shortcut for
``twistd -n llmgw local``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from llmgw.ctl import cert, fleet


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw")
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ctl = top.add_parser("ctl", help="operator commands")
    sub = ctl.add_subparsers(dest="ctl_command", required=True, metavar="COMMAND")
    cert.add_parser(sub)
    fleet.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
