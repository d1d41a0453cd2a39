"""
``llmgw ctl cert``: the private CA from the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TextIO

from llmgw.tlsconf.ca import (
    DEFAULT_LEAF_DAYS,
    CAError,
    CertificateAuthority,
    describe,
)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    cert = sub.add_parser("cert", help="the private CA: make it, issue and inspect certificates")
    csub = cert.add_subparsers(dest="cert_command", required=True, metavar="COMMAND")

    def with_dir(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--dir", default="certs", help="the CA directory (default ./certs)")
        return p

    p = with_dir(csub.add_parser("init", help="make the CA (ca.pem, ca.key)"))
    p.add_argument("--force", action="store_true", help="replace an existing CA")
    p.set_defaults(func=cmd_init)

    p = with_dir(csub.add_parser("server", help="issue the control plane's certificate"))
    p.add_argument(
        "--host", action="append", default=[],
        help="a name or IP address agents dial (repeatable); each goes into the SANs",
    )
    p.add_argument("--days", type=int, default=DEFAULT_LEAF_DAYS)
    p.set_defaults(func=cmd_server)

    p = with_dir(csub.add_parser("agent", help="issue a node's client certificate"))
    p.add_argument("node_id", metavar="NODE_ID")
    p.add_argument("--days", type=int, default=DEFAULT_LEAF_DAYS)
    p.set_defaults(func=cmd_agent)

    p = with_dir(csub.add_parser("show", help="describe a certificate file"))
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_show)


def _fail(err: TextIO, message: str) -> int:
    err.write(f"llmgw ctl cert: {message}\n")
    return 1


def cmd_init(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        ca = CertificateAuthority.init(args.dir, force=args.force)
    except CAError as e:
        return _fail(err, str(e))
    out.write(f"CA written to {ca.directory / 'ca.pem'} (key {ca.directory / 'ca.key'}, mode 0600)\n")
    return 0


def _positive_days(args: argparse.Namespace, err: TextIO) -> bool:
    if args.days <= 0:
        _fail(err, f"--days must be positive, not {args.days}")
        return False
    return True


def cmd_server(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    if not _positive_days(args, err):
        return 1
    try:
        ca = CertificateAuthority.load(args.dir)
        issued = ca.issue_server(args.host, days=args.days)
    except CAError as e:
        return _fail(err, str(e))
    out.write(f"server certificate for {', '.join(args.host)} written to {issued.cert_path}\n")
    return 0


def cmd_agent(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    if not _positive_days(args, err):
        return 1
    try:
        ca = CertificateAuthority.load(args.dir)
        issued = ca.issue_agent(args.node_id, days=args.days)
    except CAError as e:
        return _fail(err, str(e))
    out.write(f"agent certificate for node {args.node_id} written to {issued.cert_path}\n")
    return 0


def cmd_show(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        info = describe(args.file, Path(args.dir))
    except CAError as e:
        return _fail(err, str(e))
    if args.json:
        out.write(json.dumps(info, indent=2) + "\n")
        return 0
    chains = info.get("chains_to_ca")
    rows = [
        ("file", info["file"]),
        ("subject", info["subject"]),
        ("issuer", info["issuer"]),
        ("serial", info["serial"]),
        ("SANs", ", ".join(info["sans"]) or "(none)"),  # type: ignore[arg-type]
        ("usages", ", ".join(info["usages"]) or "(none)"),  # type: ignore[arg-type]
        ("CA", "yes" if info["is_ca"] else "no"),
        ("not before", info["not_before"]),
        ("not after", f"{info['not_after']} ({info['expires_in_days']} days left)"),
        (
            "chains to CA",
            {True: "yes", False: "NO", None: "unknown"}[chains]  # type: ignore[index]
            + f" ({info.get('ca')})",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        out.write(f"{k:<{width}}  {v}\n")
    return 0
