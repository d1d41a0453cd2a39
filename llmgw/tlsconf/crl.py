"""
Revocation: the CA's certificate revocation list (DESIGN §4).

Files in the CA directory, beside those of L{llmgw.tlsconf.ca}:

    crl.pem         the CRL, signed by the CA; the control plane loads it
    revoked.json    what the CA has revoked, and the last CRL number and
                    issue time it signed (so both always increase)

Every CRL carries a CRL number and an issue time (C{lastUpdate}) that are
larger than those of the CRL before it, and an explicit C{nextUpdate}: after
that date OpenSSL refuses every handshake it would check, so the CRL must be
re-signed (C{llmgw ctl cert crl --renew}) before then.

During a CA rollover C{crl.pem} holds one CRL per root the CA holds a key
for (the active one first), each listing every revoked serial: OpenSSL
checks a leaf against the CRL of its own issuer, and a root without one
would fail every handshake of its leaves.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.certs import BACKDATE
from llmgw.tlsconf.pem import CAError, write_public

CRL_FILE = "crl.pem"
STATE_FILE = "revoked.json"
DEFAULT_CRL_DAYS = 30

#: Reason names accepted by C{--reason}, as RFC 5280 spells them.
REASONS: dict[str, x509.ReasonFlags] = {
    "unspecified": x509.ReasonFlags.unspecified,
    "keyCompromise": x509.ReasonFlags.key_compromise,
    "cACompromise": x509.ReasonFlags.ca_compromise,
    "affiliationChanged": x509.ReasonFlags.affiliation_changed,
    "superseded": x509.ReasonFlags.superseded,
    "cessationOfOperation": x509.ReasonFlags.cessation_of_operation,
    "certificateHold": x509.ReasonFlags.certificate_hold,
    "privilegeWithdrawn": x509.ReasonFlags.privilege_withdrawn,
}


_CRL_BEGIN = b"-----BEGIN X509 CRL-----"


def parse_crls(data: bytes) -> list[x509.CertificateRevocationList]:
    """
    Every PEM CRL in C{data}, in order.

    @raise ValueError: a block does not parse.
    """
    out = []
    for block in data.split(_CRL_BEGIN)[1:]:
        out.append(x509.load_pem_x509_crl(_CRL_BEGIN + block))
    return out


class CRLError(Exception):
    """
    A CRL could not be made or was refused; the message names the file and
    says why, for an operator.
    """


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def parse_reason(text: str) -> x509.ReasonFlags:
    """
    The reason flag for C{text}: an RFC 5280 name, matched without regard to
    case, C{-} or C{_} (C{key-compromise} is C{keyCompromise}).

    @raise CRLError: it names no reason.
    """
    want = re.sub(r"[-_\s]", "", text).lower()
    for name, flag in REASONS.items():
        if name.lower() == want:
            return flag
    raise CRLError(f"unknown revocation reason {text!r}; choose one of {', '.join(REASONS)}")


def parse_serial(text: str) -> int:
    """
    A serial number written as hex (C{llmgw ctl cert show} prints it so),
    with an optional C{0x} and optional C{:} separators.

    @raise CRLError: it is not hex.
    """
    cleaned = text.strip().lower().removeprefix("0x").replace(":", "")
    try:
        value = int(cleaned, 16)
    except ValueError:
        raise CRLError(f"serial {text!r} is not a hexadecimal number") from None
    if value <= 0:
        raise CRLError(f"serial {text!r} is not positive")
    return value


@dataclass
class Revocation:
    serial: int
    subject: str
    reason: str
    revoked_at: datetime.datetime

    def to_json(self) -> dict[str, str]:
        return {
            "serial": format(self.serial, "x"),
            "subject": self.subject,
            "reason": self.reason,
            "revoked_at": self.revoked_at.isoformat(),
        }

    @classmethod
    def from_json(cls, d: dict[str, str]) -> Revocation:
        return cls(
            serial=int(d["serial"], 16),
            subject=d.get("subject", ""),
            reason=d.get("reason", "unspecified"),
            revoked_at=datetime.datetime.fromisoformat(d["revoked_at"]),
        )


@dataclass
class CRLState:
    """
    What the CA has revoked and the last CRL it signed.
    """

    number: int = 0
    last_update: datetime.datetime | None = None
    revoked: list[Revocation] = field(default_factory=list)

    def serials(self) -> set[int]:
        return {r.serial for r in self.revoked}


def _reason_name(flag: x509.ReasonFlags) -> str:
    for name, f in REASONS.items():
        if f is flag:
            return name
    return "unspecified"


def read_state(ca: CertificateAuthority) -> CRLState:
    """
    The revocation record in C{ca}'s directory, merged with the CRL already
    there (when it parses and is the CA's), so that neither a lost record nor
    a lost CRL can make the CRL number or issue time go backwards or drop a
    revoked serial.

    @raise CRLError: C{revoked.json} exists but does not parse.
    """
    state = CRLState()
    path = ca.directory / STATE_FILE
    if path.exists():
        try:
            raw = json.loads(path.read_text())
            state.number = int(raw.get("number", 0))
            lu = raw.get("last_update")
            state.last_update = datetime.datetime.fromisoformat(lu) if lu else None
            state.revoked = [Revocation.from_json(r) for r in raw.get("revoked", [])]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CRLError(f"{path} is damaged ({e}); fix or restore it before revoking") from e
    crl_path = ca.directory / CRL_FILE
    try:
        crls = parse_crls(crl_path.read_bytes()) if crl_path.exists() else []
    except ValueError:
        crls = []
    keys = [key.public_key() for key, _ in ca.signers()]
    for crl in crls:
        if any(crl.is_signature_valid(k) for k in keys):
            number = crl_number(crl) or 0
            state.number = max(state.number, number)
            lu = crl.last_update_utc
            if state.last_update is None or lu > state.last_update:
                state.last_update = lu
            known = state.serials()
            for entry in crl:
                if entry.serial_number not in known:
                    state.revoked.append(
                        Revocation(entry.serial_number, "", "unspecified", entry.revocation_date_utc)
                    )
    return state


def write_state(ca: CertificateAuthority, state: CRLState) -> None:
    data = {
        "number": state.number,
        "last_update": state.last_update.isoformat() if state.last_update else None,
        "revoked": [r.to_json() for r in state.revoked],
    }
    write_public(ca.directory / STATE_FILE, (json.dumps(data, indent=1) + "\n").encode())


def crl_number(crl: x509.CertificateRevocationList) -> int | None:
    try:
        return int(crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number)
    except x509.ExtensionNotFound:
        return None


def sign_crl(
    ca: CertificateAuthority,
    state: CRLState,
    days: int = DEFAULT_CRL_DAYS,
    now: datetime.datetime | None = None,
) -> x509.CertificateRevocationList:
    """
    Sign a CRL listing C{state.revoked}, with the next CRL number and an
    issue time later than the last one's, write it to C{crl.pem}, and record
    the new number and time in C{state} (and C{revoked.json}).

    The CRL is written after the record, each atomically: a crash between the
    two leaves a record ahead of the CRL, never behind it.

    @raise CRLError: C{days} is not positive.
    """
    if days <= 0:
        raise CRLError(f"the CRL's validity must be a positive number of days, not {days}")
    now = now or _now()
    # Backdated like certificates, so a control plane whose clock is a little
    # behind does not see the CRL as not yet valid and refuse every agent.
    last_update = (now - BACKDATE).replace(microsecond=0)
    if state.last_update is not None and last_update <= state.last_update:
        last_update = state.last_update.replace(microsecond=0) + datetime.timedelta(seconds=1)
    next_update = now.replace(microsecond=0) + datetime.timedelta(days=days)
    next_update = min(next_update, ca.certificate.not_valid_after_utc)
    if next_update <= last_update:
        raise CRLError(
            f"the CA certificate {ca.cert_path} expires on "
            f"{ca.certificate.not_valid_after_utc.isoformat()}; a CRL cannot outlive it"
        )
    number = state.number + 1
    crls = []
    for key, root in ca.signers():
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(root.subject)
            .last_update(last_update)
            .next_update(min(next_update, root.not_valid_after_utc))
            .add_extension(x509.CRLNumber(number), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()),
                critical=False,
            )
        )
        for r in sorted(state.revoked, key=lambda r: r.serial):
            entry = x509.RevokedCertificateBuilder().serial_number(r.serial).revocation_date(
                r.revoked_at
            )
            flag = REASONS.get(r.reason, x509.ReasonFlags.unspecified)
            if flag is not x509.ReasonFlags.unspecified:
                entry = entry.add_extension(x509.CRLReason(flag), critical=False)
            builder = builder.add_revoked_certificate(entry.build())
        crls.append(builder.sign(key, hashes.SHA256()))
    state.number = number
    state.last_update = last_update
    write_state(ca, state)
    write_public(
        ca.directory / CRL_FILE,
        b"".join(c.public_bytes(serialization.Encoding.PEM) for c in crls),
    )
    return crls[0]


@dataclass(frozen=True)
class RevokeResult:
    #: (serial, subject) of each certificate newly revoked.
    revoked: list[tuple[int, str]]
    #: Serials that were already on the CRL.
    already: list[int]
    crl: x509.CertificateRevocationList
    crl_path: Path


def _cn(subject: str) -> str | None:
    try:
        name = x509.Name.from_rfc4514_string(subject)
    except ValueError:
        return None
    cns = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(cns) != 1:
        return None
    value = cns[0].value
    return value if isinstance(value, str) else value.decode("utf-8", "replace")


def revoke(
    ca: CertificateAuthority,
    node_id: str | None = None,
    serials: Iterable[int] = (),
    reason: str = "unspecified",
    days: int = DEFAULT_CRL_DAYS,
    now: datetime.datetime | None = None,
    admin: str | None = None,
) -> RevokeResult:
    """
    Revoke every certificate the CA issued to node C{node_id}, every admin
    certificate it issued to C{admin}, and/or the certificates with
    C{serials}, and sign a new CRL.

    Serials are looked up in the CA's issue record (C{issued.jsonl}), so a
    mistyped serial is refused rather than silently listed.

    @raise CRLError: nothing matches, the reason is unknown, or a serial is
        the CA's own.
    """
    flag = parse_reason(reason)
    now = now or _now()
    records = ca.issued()
    by_serial: dict[int, dict[str, object]] = {}
    for rec in records:
        try:
            by_serial[int(str(rec["serial"]), 16)] = rec
        except (KeyError, ValueError):
            continue
    targets: dict[int, str] = {}
    if node_id is not None:
        for serial, rec in by_serial.items():
            if rec.get("kind") == "agent" and _cn(str(rec.get("subject", ""))) == node_id:
                targets[serial] = str(rec.get("subject", ""))
        if not targets:
            raise CRLError(
                f"the CA in {ca.directory} has no record of issuing a certificate to node "
                f"{node_id!r} (see {ca.directory / 'issued.jsonl'}); revoke by --serial instead"
            )
    if admin is not None:
        found_admin = False
        for serial, rec in by_serial.items():
            if str(rec.get("kind", "")).startswith("admin-") and _cn(str(rec.get("subject", ""))) == admin:
                targets[serial] = str(rec.get("subject", ""))
                found_admin = True
        if not found_admin:
            raise CRLError(
                f"the CA in {ca.directory} has no record of issuing an admin certificate to "
                f"{admin!r} (see {ca.directory / 'issued.jsonl'}); revoke by --serial instead"
            )
    for serial in serials:
        if serial == ca.certificate.serial_number:
            raise CRLError(
                "that serial is the CA's own certificate; a CA cannot revoke itself "
                "(make a new CA with `llmgw ctl cert init --force` instead)"
            )
        found = by_serial.get(serial)
        if found is None:
            raise CRLError(
                f"the CA in {ca.directory} has no record of issuing serial {serial:x} "
                f"(see {ca.directory / 'issued.jsonl'})"
            )
        targets[serial] = str(found.get("subject", ""))
    if not targets:
        raise CRLError("name a node id, an --admin or a --serial to revoke")
    state = read_state(ca)
    known = state.serials()
    newly: list[tuple[int, str]] = []
    already: list[int] = []
    for serial, subject in sorted(targets.items()):
        if serial in known:
            already.append(serial)
            continue
        state.revoked.append(Revocation(serial, subject, _reason_name(flag), now.replace(microsecond=0)))
        newly.append((serial, subject))
    crl = sign_crl(ca, state, days=days, now=now)
    return RevokeResult(newly, already, crl, ca.directory / CRL_FILE)


def renew(
    ca: CertificateAuthority, days: int = DEFAULT_CRL_DAYS, now: datetime.datetime | None = None
) -> x509.CertificateRevocationList:
    """
    Re-sign the CRL with the same entries and a new next-update (a CA with
    nothing revoked gets an empty CRL, which is still checked).

    @raise CRLError: the revocation record is damaged.
    """
    return sign_crl(ca, read_state(ca), days=days, now=now)


def load_crl(
    path: Path | str, ca: x509.Certificate, now: datetime.datetime | None = None
) -> x509.CertificateRevocationList:
    """
    Read and check a CRL: it parses, the CA signed it, and it is current
    (issued no later than C{now}, next update after C{now}).

    @raise CRLError: naming the file and what is wrong with it.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CRLError(f"cannot read CRL {path}: {e.strerror}") from e
    try:
        crls = parse_crls(data)
    except ValueError as e:
        raise CRLError(f"CRL {path} is not a PEM certificate revocation list: {e}") from e
    if not crls:
        raise CRLError(f"CRL {path} is not a PEM certificate revocation list: no CRL in it")
    crl = next((c for c in crls if c.issuer == ca.subject), crls[0])
    if crl.issuer != ca.subject:
        raise CRLError(
            f"CRL {path} was issued by {crl.issuer.rfc4514_string()}, not by this CA "
            f"({ca.subject.rfc4514_string()})"
        )
    try:
        valid = crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise CRLError(f"CRL {path} is not signed by the CA ({ca.subject.rfc4514_string()})")
    now = now or _now()
    next_update = crl.next_update_utc
    if next_update is None:
        raise CRLError(f"CRL {path} has no next-update date; re-sign it with `llmgw ctl cert crl --renew`")
    if next_update <= now:
        raise CRLError(
            f"CRL {path} expired on {next_update.isoformat()} (its next-update); "
            "re-sign it with `llmgw ctl cert crl --renew`"
        )
    if crl.last_update_utc > now:
        raise CRLError(
            f"CRL {path} is not valid before {crl.last_update_utc.isoformat()}; "
            "check this machine's clock"
        )
    return crl


def load_crls(
    path: Path | str, roots: Iterable[x509.Certificate], now: datetime.datetime | None = None
) -> list[x509.CertificateRevocationList]:
    """
    The CRLs in C{path}, one for each of C{roots} (as L{load_crl} checks
    it), in the order of C{roots}.

    @raise CRLError: one is missing for a root, or is refused by
        L{load_crl}; the message names the root.
    """
    return [load_crl(path, root, now) for root in roots]


def revoked_serials(crl: x509.CertificateRevocationList) -> frozenset[int]:
    return frozenset(entry.serial_number for entry in crl)


def describe_crl(path: Path | str, ca: x509.Certificate | None = None) -> dict[str, object]:
    """
    What C{llmgw ctl cert crl} prints: number, issue time, next update and
    the revoked serials; and, with C{ca}, whether it checks out.

    @raise CRLError: the file is missing or not a CRL.
    """
    path = Path(path)
    try:
        crls = parse_crls(path.read_bytes())
    except OSError as e:
        raise CRLError(f"cannot read CRL {path}: {e.strerror}") from e
    except ValueError as e:
        raise CRLError(f"CRL {path} is not a PEM certificate revocation list: {e}") from e
    if not crls:
        raise CRLError(f"CRL {path} is not a PEM certificate revocation list: no CRL in it")
    crl = crls[0]
    if ca is not None:
        crl = next((c for c in crls if c.issuer == ca.subject), crl)
    now = _now()
    nu = crl.next_update_utc
    info: dict[str, object] = {
        "file": str(path),
        "crls": len(crls),
        "issuer": crl.issuer.rfc4514_string(),
        "number": crl_number(crl),
        "last_update": crl.last_update_utc.isoformat(),
        "next_update": nu.isoformat() if nu else None,
        "next_update_in_days": round((nu - now).total_seconds() / 86400, 1) if nu else None,
        "revoked": [
            {"serial": format(e.serial_number, "x"), "revoked_at": e.revocation_date_utc.isoformat()}
            for e in crl
        ],
    }
    if ca is not None:
        try:
            load_crl(path, ca)
            info["valid"] = True
            info["problem"] = None
        except CRLError as e:
            info["valid"] = False
            info["problem"] = str(e)
    return info


__all__ = [
    "CAError",
    "CRLError",
    "DEFAULT_CRL_DAYS",
    "describe_crl",
    "load_crl",
    "load_crls",
    "parse_crls",
    "parse_reason",
    "parse_serial",
    "renew",
    "revoke",
    "revoked_serials",
]
