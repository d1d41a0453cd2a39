"""
C{llmgw ctl csr list|approve NODE|deny NODE}: the certificate requests
(joins, renewals) a control plane without C{--signer} keeps for an
operator, from C{GET /api/v1/csr}.

C{approve} runs where the CA's key is (C{--ca}, default C{--certs} or
C{./certs}): it fetches the request, checks it as the control plane's
signer would, signs it here with the active root, notes it in the CA's
C{issued.jsonl} (so C{ctl cert revoke NODE} finds it) and posts the
certificate, which the control plane checks again before the node gets it.
The CA's key never leaves this machine.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO
from urllib.parse import quote

from llmgw.ctl.client import EXIT_REFUSED, EXIT_USAGE, CtlError
from llmgw.ctl.fleet import AdminClient, HTTPFunction, _run
from llmgw.ctl.render import ago
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.csr import DEFAULT_NODE_LIFETIME, RequestRefused, check_request, sign_request
from llmgw.tlsconf.pem import CAError, cert_pem

ACTIONS = ("list", "approve", "deny")


def _days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days") from None
    if not 1 / 1440 <= days <= 3650:
        raise argparse.ArgumentTypeError(f"--days {text}: between one minute (0.0007) and 3650")
    return days


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=ACTIONS,
                        help="list: the requests waiting; approve: sign one with the CA here and send it; "
                        "deny: refuse one")
    parser.add_argument("node", metavar="NODE", nargs="?", help="the node whose request (approve, deny)")
    parser.add_argument("--ca", metavar="DIR", default=None,
                        help="with approve: the CA directory (ca.pem, ca.key); default --certs or ./certs")
    parser.add_argument("--days", type=_days, default=DEFAULT_NODE_LIFETIME.total_seconds() / 86400,
                        help="with approve: the certificate's lifetime in days (default 30)")
    parser.add_argument("--reason", default="", help="with deny: why, told to the node")


def render(rows: list[dict[str, Any]], now: float) -> str:
    lines = [f"{'NODE':<24} {'KIND':<8} {'STATE':<9} {'KEY':<17} {'TOKEN':<9} {'ADDRESS':<22} AGE"]
    for r in rows:
        lines.append(f"{str(r.get('node')):<24} {str(r.get('kind')):<8} {str(r.get('state')):<9} "
                     f"{str(r.get('key')):<17} {str(r.get('token') or '-'):<9} {str(r.get('address')):<22} "
                     f"{ago(r.get('since'), now)}")
    if not rows:
        lines.append("(no certificate request waits)")
    return "\n".join(lines) + "\n"


def sign_waiting(row: dict[str, Any], node: str, ca_dir: str, days: float) -> bytes:
    """
    The certificate for the request C{row} (as C{GET /api/v1/csr} lists it),
    signed with the CA in C{ca_dir} and noted in its record.

    @raise CtlError: the request is not one a signer would take, or the CA
        cannot be loaded.
    """
    try:
        csr = check_request(str(row.get("csr", "")).encode("ascii", "replace"), node)
    except RequestRefused as e:
        raise CtlError(EXIT_REFUSED, f"node {node}'s request is not signed: {e}") from None
    try:
        ca = CertificateAuthority.load(ca_dir)
    except CAError as e:
        raise CtlError(EXIT_USAGE, f"{e} (approve runs where the CA's key is: --ca DIR)") from None
    cert = sign_request(csr, node, ca.key, ca.certificate, datetime.timedelta(days=days))
    ca.record_signed(cert, "approved")
    return cert_pem(cert)


def cmd_csr(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
            http: HTTPFunction | None = None, now: float | None = None) -> int:
    if args.action != "list" and not args.node:
        (err or sys.stderr).write(f"llmgw ctl csr {args.action}: name the node (`llmgw ctl csr list`)\n")
        return EXIT_USAGE

    def body(client: AdminClient) -> tuple[Any, Callable[[], str]]:
        when = now if now is not None else time.time()
        if args.action == "list":
            answer = client.get("/api/v1/csr")
            return answer, lambda: render(list(answer["requests"]), when)
        path = f"/api/v1/csr/{quote(args.node, safe='')}"
        if args.action == "deny":
            answer = client.post(f"{path}/deny", {"reason": args.reason} if args.reason else {})
            return answer, lambda: f"certificate request of node {args.node} denied\n"
        rows = [r for r in client.get("/api/v1/csr")["requests"] if r.get("node") == args.node]
        if not rows or rows[0].get("state") != "pending":
            raise CtlError(EXIT_REFUSED, f"no certificate request of node {args.node} waits "
                                         f"(`llmgw ctl csr list`)")
        pem = sign_waiting(rows[0], args.node, args.ca or args.certs or "certs", args.days)
        answer = client.post(f"{path}/approve", {"certificate_pem": pem.decode("ascii")})
        return answer, lambda: (f"certificate request ({rows[0].get('kind')}) of node {args.node} approved: "
                                f"signed here for {args.days:g} days\n")

    return _run(args, out, err, http, body)
