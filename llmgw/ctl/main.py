"""
The ``llmgw`` console script.

``llmgw ctl ...`` is the operator CLI; ``llmgw local`` is a shortcut for
``twistd -n llmgw local``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from llmgw.ctl import catalog as catalog_cmd
from llmgw.ctl import cert, fleet


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw")
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ctl = top.add_parser("ctl", help="operator commands")
    sub = ctl.add_subparsers(dest="ctl_command", required=True, metavar="COMMAND")
    cert.add_parser(sub)
    fleet.add_parsers(sub)
    catalog_cmd.add_parser(sub)
    local = top.add_parser(
        "local", help="run the local fleet (twistd -n llmgw local); --help lists its options",
        add_help=False,
    )
    local.set_defaults(func=lambda args: run_local([]))
    return parser


def run_local(args: Sequence[str]) -> int:
    """
    Run C{twistd -n llmgw local ARGS} in this process: twistd owns logging,
    signals and the reactor, exactly as when started by hand.
    """
    from twisted.scripts.twistd import run

    sys.argv = ["twistd", "--nodaemon", "--pidfile=", "llmgw", "local", *args]
    run()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["local"]:
        # Everything after `local` is twistd's to parse.
        return run_local(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
