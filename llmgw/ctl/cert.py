"""
``llmgw ctl cert``: the private CA from the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from llmgw.options import add_old_name
from llmgw.tlsconf.ca import (
    DEFAULT_CA_DAYS,
    DEFAULT_LEAF_DAYS,
    FORCE,
    REFUSE,
    RENEW,
    CertificateAuthority,
    Issued,
)
from llmgw.tlsconf.crl import (
    CRL_FILE,
    DEFAULT_CRL_DAYS,
    REASONS,
    CRLError,
    crl_number,
    describe_crl,
    parse_serial,
    renew,
    revoke,
)
from llmgw.tlsconf.describe import describe
from llmgw.tlsconf.pem import CAError, load_certificate
from llmgw.tlsconf.roles import ADMIN_ROLES


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    cert = sub.add_parser("cert", help="the private CA: make it, issue and inspect certificates")
    csub = cert.add_subparsers(dest="cert_command", required=True, metavar="COMMAND")

    def with_dir(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--certs", dest="dir", default="certs", metavar="DIR",
                       help="the certificates directory, where the CA is (default ./certs)")
        add_old_name(p, "dir", "certs", "dir", metavar="DIR")
        return p

    p = with_dir(csub.add_parser("init", help="make the CA (ca.pem, ca.key)"))
    p.add_argument("--force", action="store_true", help="replace an existing CA")
    p.set_defaults(func=cmd_init)

    def replacing(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        group = p.add_mutually_exclusive_group()
        group.add_argument(
            "--renew", action="store_true",
            help="replace an existing certificate and key, saying what was replaced",
        )
        group.add_argument("--force", action="store_true", help="replace an existing key silently")
        return p

    def shared_ca(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--shared-ca", action="store_true",
            help="issue it even if the CA directory issues both etcd and node/admin certificates "
            "(then etcd takes every agent's certificate as a client: not for production)",
        )

    p = replacing(with_dir(csub.add_parser("server", help="issue the control plane's certificate")))
    p.add_argument(
        "--host", action="append", default=[],
        help="a name or IP address agents (and admin clients) dial (repeatable); each goes into the SANs",
    )
    p.add_argument("--days", type=int, default=DEFAULT_LEAF_DAYS,
                   help=f"how long the certificate is valid, in days (default {DEFAULT_LEAF_DAYS})")
    p.set_defaults(func=cmd_server)

    p = replacing(with_dir(csub.add_parser("agent", help="issue a node's client certificate")))
    p.add_argument("node_id", metavar="NODE_ID", help="the node's id (the certificate's common name)")
    p.add_argument("--days", type=int, default=DEFAULT_LEAF_DAYS,
                   help=f"how long the certificate is valid, in days (default {DEFAULT_LEAF_DAYS})")
    shared_ca(p)
    p.set_defaults(func=cmd_agent)

    p = replacing(with_dir(csub.add_parser(
        "etcd", help="issue a certificate for etcd's own TLS (DIR/etcd-NAME.pem/.key): an etcd "
        "member's client and peer certificate (--host each address in its URLs), or a control-plane "
        "member's etcd client certificate (no --host); from a CA directory of its own (refused "
        "from one that issued node or admin certificates)",
    )))
    p.add_argument("name", metavar="NAME", help="the etcd member's or the control-plane member's name")
    p.add_argument("--host", action="append", default=[],
                   help="a name or IP address in the etcd member's client and peer URLs (repeatable)")
    p.add_argument("--days", type=int, default=DEFAULT_LEAF_DAYS,
                   help=f"how long the certificate is valid, in days (default {DEFAULT_LEAF_DAYS})")
    shared_ca(p)
    p.set_defaults(func=cmd_etcd)

    p = replacing(with_dir(csub.add_parser(
        "admin", help="issue an admin API client certificate with a role (DIR/admin-NAME.pem/.key)",
    )))
    p.add_argument("name", metavar="NAME", help="who holds it (logged on every change it makes)")
    p.add_argument(
        "--role", required=True, choices=ADMIN_ROLES,
        help="viewer: reads; operator: also cordon, uncordon, drain, scale, reload; "
        "gateway: reads routes only (a standalone gateway)",
    )
    p.add_argument("--days", type=int, default=DEFAULT_LEAF_DAYS,
                   help=f"how long the certificate is valid, in days (default {DEFAULT_LEAF_DAYS})")
    shared_ca(p)
    p.set_defaults(func=cmd_admin)

    p = with_dir(csub.add_parser(
        "rotate-ca",
        help="start a CA rollover: a new root beside the old, ca.pem holding both; "
        "new certificates come from the new one",
    ))
    p.add_argument("--days", type=int, default=DEFAULT_CA_DAYS,
                   help=f"how long the new root is valid, in days (default {DEFAULT_CA_DAYS})")
    p.set_defaults(func=cmd_rotate_ca)

    p = with_dir(csub.add_parser(
        "retire-ca", help="end a CA rollover: the old root leaves ca.pem and its key is deleted",
    ))
    p.add_argument(
        "--force", action="store_true",
        help="retire even though certificates in DIR were issued by the old root",
    )
    p.set_defaults(func=cmd_retire_ca)

    p = with_dir(csub.add_parser("show", help="describe a certificate file"))
    p.add_argument("file", metavar="FILE", help="a PEM certificate")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_show)

    p = with_dir(csub.add_parser(
        "revoke",
        help="revoke a node's certificates (or one serial) and re-sign DIR/crl.pem",
    ))
    p.add_argument("node_id", metavar="NODE_ID", nargs="?", help="revoke every certificate issued to this node")
    p.add_argument("--serial", action="append", default=[], help="a serial in hex, as `show` prints it (repeatable)")
    p.add_argument("--admin", metavar="NAME", help="revoke every admin certificate issued to NAME")
    p.add_argument("--reason", default="unspecified", help=f"one of {', '.join(REASONS)}")
    p.add_argument("--days", type=int, default=DEFAULT_CRL_DAYS, help=f"the CRL's next-update, in days (default {DEFAULT_CRL_DAYS})")
    p.set_defaults(func=cmd_revoke)

    p = with_dir(csub.add_parser("crl", help="show DIR/crl.pem, or re-sign it with --renew"))
    p.add_argument("--renew", action="store_true", help="re-sign the CRL with a new next-update")
    p.add_argument("--days", type=int, default=DEFAULT_CRL_DAYS, help=f"the CRL's next-update, in days (default {DEFAULT_CRL_DAYS})")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_crl)


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


def _replace_mode(args: argparse.Namespace) -> str:
    if getattr(args, "renew", False):
        return RENEW
    if getattr(args, "force", False):
        return FORCE
    return REFUSE


def _written(out: TextIO, what: str, issued: Issued, renew: bool) -> None:
    out.write(f"{what} written to {issued.cert_path} (key {issued.key_path}, mode 0600)\n")
    old = issued.replaced
    if old is not None and renew:
        out.write(
            f"replaced serial {old.serial_number:x} ({old.subject.rfc4514_string()}, issued by "
            f"{old.issuer.rfc4514_string()}, valid until {old.not_valid_after_utc.isoformat()}); "
            "it stays valid until then unless revoked (`llmgw ctl cert revoke --serial "
            f"{old.serial_number:x}`)\n"
        )


def _issue(
    args: argparse.Namespace,
    out: TextIO | None,
    err: TextIO | None,
    issue: Callable[[CertificateAuthority, str], Issued],
    what: str,
) -> int:
    """
    What every C{ctl cert} command that issues a leaf does: check
    C{--days}, load the CA, C{issue} (given the CA and the replace mode),
    and say what was written (and, with C{--renew}, what it replaced).
    """
    out, err = out or sys.stdout, err or sys.stderr
    if not _positive_days(args, err):
        return 1
    try:
        issued = issue(CertificateAuthority.load(args.dir), _replace_mode(args))
    except CAError as e:
        return _fail(err, str(e))
    _written(out, what, issued, args.renew)
    return 0


def cmd_server(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    return _issue(args, out, err, lambda ca, replace: ca.issue_server(args.host, days=args.days, replace=replace),
                  f"server certificate for {', '.join(args.host)}")


def cmd_agent(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    return _issue(args, out, err, lambda ca, replace: ca.issue_agent(
        args.node_id, days=args.days, replace=replace, shared=args.shared_ca),
        f"agent certificate for node {args.node_id}")


def cmd_etcd(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    hosts = f" for {', '.join(args.host)}" if args.host else ""
    return _issue(args, out, err, lambda ca, replace: ca.issue_etcd(
        args.name, args.host, days=args.days, replace=replace, shared=args.shared_ca),
        f"etcd certificate {args.name}{hosts} (server and client)")


def cmd_admin(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    return _issue(args, out, err, lambda ca, replace: ca.issue_admin(
        args.name, args.role, days=args.days, replace=replace, shared=args.shared_ca),
        f"admin certificate for {args.name} (role {args.role})")


def cmd_rotate_ca(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    if not _positive_days(args, err):
        return 1
    try:
        ca = CertificateAuthority.load(args.dir)
        old = ca.certificate
        new = ca.rotate(days=args.days)
        if (ca.directory / CRL_FILE).exists():
            renew(ca)
    except (CAError, CRLError) as e:
        return _fail(err, str(e))
    out.write(
        f"new root {new.subject.rfc4514_string()} (serial {new.serial_number:x}) now issues; "
        f"old root {old.subject.rfc4514_string()} kept in {ca.directory / 'ca-previous.pem'}\n"
        f"{ca.cert_path} now holds both roots: copy it to every agent, admin client and gateway "
        "and send them SIGHUP, then SIGHUP the control plane; then renew each certificate "
        "(--renew) and finish with `llmgw ctl cert retire-ca` (docs/operations.md)\n"
    )
    return 0


def cmd_retire_ca(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        ca = CertificateAuthority.load(args.dir)
        old, stale = ca.retire(force=args.force)
        if (ca.directory / CRL_FILE).exists():
            renew(ca)
    except (CAError, CRLError) as e:
        return _fail(err, str(e))
    for path in stale:
        out.write(f"warning: {path.name} was issued by the retired root and no longer works\n")
    out.write(
        f"root {old.subject.rfc4514_string()} (serial {old.serial_number:x}) retired: its key "
        f"is deleted and {ca.cert_path} holds {len(ca.roots)} root(s); copy it everywhere and "
        "send SIGHUP: from then on only certificates of the new root connect\n"
    )
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
        ("key usages", ", ".join(info["key_usages"]) or "(none)"),  # type: ignore[arg-type]
        ("CA", "yes" if info["is_ca"] else "no"),
        ("not before", info["not_before"]),
        ("not after", f"{info['not_after']} ({info['expires_in_days']} days left)"),
        (
            "chains to CA",
            {True: "yes", False: "NO", None: "unknown"}[chains]  # type: ignore[index]
            + f" ({info.get('ca')})",
        ),
    ]
    crl = _crl_row(Path(args.dir), str(info["serial"]))
    if crl is not None:
        rows.append(("CRL", crl))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        out.write(f"{k:<{width}}  {v}\n")
    return 0


def _crl_row(ca_dir: Path, serial: str) -> str | None:
    """
    The CRL's next-update and whether it lists C{serial}, for C{show}.
    """
    path = ca_dir / CRL_FILE
    if not path.exists():
        return None
    try:
        ca = load_certificate(ca_dir / "ca.pem")
    except CAError:
        ca = None
    try:
        crl = describe_crl(path, ca)
    except CRLError as e:
        return f"unreadable: {e}"
    listed = any(r["serial"] == serial for r in crl["revoked"])  # type: ignore[attr-defined]
    text = (
        f"{path} number {crl['number']}, next update {crl['next_update']} "
        f"({crl['next_update_in_days']} days left)"
    )
    if crl.get("valid") is False:
        text += f"; REFUSED: {crl['problem']}"
    return text + ("; this certificate is REVOKED" if listed else "; not revoked")


def cmd_revoke(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    if not _positive_days(args, err):
        return 1
    if not args.node_id and not args.serial and not args.admin:
        return _fail(err, "name a NODE_ID, or give --admin NAME or --serial S")
    try:
        serials = [parse_serial(s) for s in args.serial]
        ca = CertificateAuthority.load(args.dir)
        result = revoke(ca, node_id=args.node_id, serials=serials, reason=args.reason,
                        days=args.days, admin=args.admin)
    except (CAError, CRLError) as e:
        return _fail(err, str(e))
    for serial, subject in result.revoked:
        out.write(f"revoked serial {serial:x} ({subject})\n")
    for serial in result.already:
        out.write(f"serial {serial:x} was already revoked\n")
    nu = result.crl.next_update_utc
    out.write(
        f"{result.crl_path} signed: CRL number {crl_number(result.crl)}, "
        f"next update {nu.isoformat() if nu else '?'}; "
        "send the control plane SIGHUP to load it and close the revoked streams\n"
    )
    return 0


def cmd_crl(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    path = Path(args.dir) / CRL_FILE
    if args.renew:
        if not _positive_days(args, err):
            return 1
        try:
            ca = CertificateAuthority.load(args.dir)
            crl = renew(ca, days=args.days)
        except (CAError, CRLError) as e:
            return _fail(err, str(e))
        nu = crl.next_update_utc
        out.write(
            f"{path} re-signed: CRL number {crl_number(crl)}, next update "
            f"{nu.isoformat() if nu else '?'}; send the control plane SIGHUP to load it\n"
        )
        return 0
    try:
        ca_cert = load_certificate(Path(args.dir) / "ca.pem")
    except CAError:
        ca_cert = None
    try:
        info = describe_crl(path, ca_cert)
    except CRLError as e:
        return _fail(err, f"{e} (make one with `llmgw ctl cert crl --renew`)")
    if args.json:
        out.write(json.dumps(info, indent=2) + "\n")
        return 0
    revoked = info["revoked"]
    rows = [
        ("file", info["file"]),
        ("issuer", info["issuer"]),
        ("number", info["number"]),
        ("issued", info["last_update"]),
        ("next update", f"{info['next_update']} ({info['next_update_in_days']} days left)"),
        ("revoked", ", ".join(r["serial"] for r in revoked) or "(none)"),  # type: ignore[attr-defined]
        ("valid", {True: "yes", False: f"NO: {info.get('problem')}", None: "unknown (no ca.pem)"}[
            info.get("valid")  # type: ignore[index]
        ]),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        out.write(f"{k:<{width}}  {v}\n")
    return 0
