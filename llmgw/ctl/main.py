"""
The ``llmgw`` console script.

``llmgw ctl ...`` is the operator CLI; ``llmgw local`` is a shortcut for
``twistd -n llmgw local``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from llmgw.ctl import catalog as catalog_cmd
from llmgw.ctl import cert, fleet, token, user
from llmgw.options import version_text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw")
    parser.add_argument("--version", action="version", version=version_text(),
                        help="print llmgw's version (and Twisted's) and exit")
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ctl = top.add_parser("ctl", help="operator commands")
    sub = ctl.add_subparsers(dest="ctl_command", required=True, metavar="COMMAND")
    cert.add_parser(sub)
    token.add_parser(sub)
    user.add_parser(sub)
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


#: The status when the reader of our output went away: 128 + SIGPIPE.
EXIT_PIPE = 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    """
    Run the C{llmgw} command line; returns the exit status. Output into a
    pipe closed early (C{llmgw ctl nodes | head -1}) ends quietly with
    L{EXIT_PIPE}, what a shell reports for a command ended by SIGPIPE; 1
    would read as "the control plane refused" to a script.
    """
    try:
        try:
            code = _main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                sys.stderr.write(f"{e.code}\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader is gone: point stdout at /dev/null, so that the flush
        # at exit does not fail again with a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PIPE
    return code


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["local"]:
        # Everything after `local` is twistd's to parse.
        return run_local(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
