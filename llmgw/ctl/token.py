"""
C{llmgw ctl token create|list|revoke}: join tokens, kept in the control
plane's certificates directory (C{join-tokens.json}), which the control
plane reads again when it changes. Run where that directory is.

With C{--etcd} (an HA control plane) the tokens are etcd's
(L{llmgw.control.ha.sharedtokens}), which every member reads; the
certificates directory still gives the CA's hash a token carries.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TextIO

from llmgw.control.core.jointokens import TokenFile
from llmgw.control.ha.sharedtokens import SharedTokens
from llmgw.ctl.etcdkv import add_etcd_arguments, etcd_of, result_of
from llmgw.etcd import EtcdError
from llmgw.tlsconf.csr import spki_hash
from llmgw.tlsconf.jointoken import printable
from llmgw.tlsconf.pem import CAError, load_bundle

CERTS_ENV = "LLMGW_CERTS"


def _seconds(text: str) -> float:
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    t = text.strip().lower()
    try:
        return float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (1h, 30m, 2d)") from None


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("token", help="join tokens: create, list, revoke")
    p.add_argument("--certs", default=os.environ.get(CERTS_ENV) or "certs", metavar="DIR",
                   help="the control plane's certificates directory (default $LLMGW_CERTS or certs)")
    # Also after the command, as `llmgw ctl cert server --certs DIR` takes it.
    certs = argparse.ArgumentParser(add_help=False)
    certs.add_argument("--certs", default=argparse.SUPPRESS, metavar="DIR",
                       help="the control plane's certificates directory")
    add_etcd_arguments(p)
    add_etcd_arguments(certs)
    s = p.add_subparsers(dest="token_command", required=True, metavar="COMMAND")
    c = s.add_parser("create", help="print a new join token", parents=[certs])
    c.add_argument("--ttl", type=_seconds, default=3600.0, help="how long it is valid (default 1h)")
    c.add_argument("--uses", type=int, default=1, help="how many nodes may join with it (default 1)")
    c.add_argument("--node-prefix", default="", help="the names it admits start with this")
    c.set_defaults(func=cmd_create)
    ls = s.add_parser("list", help="every token: state, uses, the nodes that joined", parents=[certs])
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=cmd_list)
    r = s.add_parser("revoke", help="a token nobody may join with any more", parents=[certs])
    r.add_argument("id", help="the token's id (`llmgw ctl token list`)")
    r.set_defaults(func=cmd_revoke)


def _file(args: argparse.Namespace) -> TokenFile:
    tokens = TokenFile(Path(args.certs) / "join-tokens.json")
    tokens.load()
    return tokens


def _shared(args: argparse.Namespace) -> SharedTokens | None:
    """The tokens in etcd with --etcd, else None (the certificates directory's file)."""
    found = etcd_of(args)
    return SharedTokens(found[0], found[1]) if found is not None else None


def cmd_create(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        ca_hash = spki_hash(load_bundle(Path(args.certs) / "ca.pem")[0])
    except CAError as e:
        err.write(f"llmgw ctl token create: {e}\n")
        return 1
    shared = _shared(args)
    try:
        if shared is not None:
            token, secret = result_of(shared.create(time.time(), args.ttl, args.uses, args.node_prefix))
        else:
            tokens = _file(args)
            token, secret = tokens.book.create(time.time(), args.ttl, args.uses, args.node_prefix)
            tokens.save()
    except EtcdError as e:
        err.write(f"llmgw ctl token create: {e}\n")
        return 1
    except ValueError as e:
        err.write(f"llmgw ctl token create: {e}\n")
        return 2
    out.write(printable(token.id, secret, ca_hash) + "\n")
    return 0


def cmd_list(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    shared = _shared(args)
    try:
        rows = result_of(shared.listing(time.time())) if shared is not None else _file(args).book.listing(time.time())
    except EtcdError as e:
        err.write(f"llmgw ctl token list: {e}\n")
        return 1
    if getattr(args, "json", False):
        out.write(json.dumps(rows, indent=2) + "\n")
        return 0
    out.write(f"{'ID':<10} {'STATE':<9} {'USED':>9} {'EXPIRES':<20} PREFIX\n")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["expires"]))
        out.write(f"{r['id']:<10} {r['state']:<9} {r['used']:>4}/{r['uses']:<4} {when:<20} {r['node_prefix']}\n")
    return 0


def cmd_revoke(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    shared = _shared(args)
    try:
        if shared is not None:
            result_of(shared.revoke(args.id))
        else:
            tokens = _file(args)
            tokens.book.revoke(args.id)
            tokens.save()
    except KeyError:
        err.write(f"llmgw ctl token revoke: no token {args.id!r} (`llmgw ctl token list`)\n")
        return 1
    except (EtcdError, ValueError) as e:
        err.write(f"llmgw ctl token revoke: {e}\n")
        return 1
    out.write(f"token {args.id} revoked\n")
    return 0
