"""
``llmgw ctl catalog apply FILE --etcd URL[,URL...]``: validate a catalog
and store it in etcd for an HA control plane (DESIGN §17).

The write is a compare-and-swap against the leader's lease: it succeeds
only while the leader key exists and carries the lease read just before,
so a catalog is never stored while no member leads (nobody would apply it
with a fenced epoch) and an election in between makes it fail (try again).
The leader applies it through its watch. etcd is spoken to over its JSON
gateway with the standard library (this is a one-shot command, not a
reactor program).
"""

from __future__ import annotations

import argparse
import base64
import json
import ssl
import sys
import urllib.error
import urllib.request
from typing import Any, TextIO

from llmgw.control.core.catalog import CatalogError, load_catalog
from llmgw.control.ha.election import MemberInfo, leader_key
from llmgw.control.ha.member import catalog_key


class CatalogApplyError(Exception):
    pass


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class SyncEtcd:
    """The two etcd calls this command needs, over the JSON gateway."""

    def __init__(self, urls: list[str], context: ssl.SSLContext | None = None, timeout: float = 5.0):
        self.urls = urls
        self.context = context
        self.timeout = timeout

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        errors = []
        for url in self.urls:
            req = urllib.request.Request(
                url + "/v3" + path, data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"}, method="POST",
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout, context=self.context) as r:
                    return json.loads(r.read())  # type: ignore[no-any-return]
            except urllib.error.HTTPError as e:
                raise CatalogApplyError(f"etcd at {url} refused {path}: {e.read()[:300]!r}") from e
            except (urllib.error.URLError, OSError) as e:
                errors.append(f"{url}: {getattr(e, 'reason', e)}")
        raise CatalogApplyError("no etcd member answered: " + "; ".join(errors))


def apply_catalog(etcd: SyncEtcd, prefix: str, text: bytes) -> dict[str, Any]:
    """
    Store C{text} as the catalog under the current leader's lease.

    @raise CatalogApplyError: no leader, or the compare-and-swap failed.
    """
    lkey = leader_key(prefix)
    answer = etcd.call("/kv/range", {"key": _b64(lkey)})
    kvs = answer.get("kvs", [])
    if not kvs:
        raise CatalogApplyError(
            f"no control-plane member leads (no {lkey.decode()} in etcd): the catalog is stored "
            "only under a leader's lease; try again once one leads"
        )
    lease = kvs[0].get("lease", "0")
    leader = MemberInfo.decode(base64.b64decode(kvs[0].get("value", "")))
    result = etcd.call("/kv/txn", {
        "compare": [{"key": _b64(lkey), "target": "LEASE", "result": "EQUAL", "lease": lease}],
        "success": [{"request_put": {"key": _b64(catalog_key(prefix)), "value": _b64(text)}}],
        "failure": [],
    })
    if not result.get("succeeded"):
        raise CatalogApplyError("the leader changed while storing the catalog: nothing was stored; try again")
    return {
        "stored": catalog_key(prefix).decode(),
        "revision": int(result["header"]["revision"]),
        "leader": leader.member_id if leader else None,
    }


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    cat = sub.add_parser("catalog", help="the catalog of an HA control plane, in etcd")
    csub = cat.add_subparsers(dest="catalog_command", required=True, metavar="COMMAND")
    p = csub.add_parser("apply", help="validate FILE and store it in etcd; the leader applies it")
    p.add_argument("file", metavar="FILE", help="the catalog TOML")
    p.add_argument("--etcd", required=True, help="comma-separated etcd client URLs")
    p.add_argument("--etcd-ca", help="CA bundle of etcd's server certificates (https)")
    p.add_argument("--etcd-cert", help="client certificate for etcd (https)")
    p.add_argument("--etcd-key", help="the key of --etcd-cert")
    p.add_argument("--etcd-prefix", default="/llmgw",
                   help="key prefix of the control plane's state in etcd (default /llmgw)")
    p.set_defaults(func=cmd_apply)


def cmd_apply(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        catalog = load_catalog(args.file)
    except CatalogError as e:
        print(f"refused, nothing stored: {e}", file=err)
        return 1
    with open(args.file, "rb") as f:
        text = f.read()
    context = None
    if args.etcd_ca or args.etcd_cert:
        context = ssl.create_default_context(cafile=args.etcd_ca)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if args.etcd_cert:
            context.load_cert_chain(args.etcd_cert, args.etcd_key)
    urls = [u.strip().rstrip("/") for u in args.etcd.split(",") if u.strip()]
    try:
        result = apply_catalog(SyncEtcd(urls, context), args.etcd_prefix.rstrip("/"), text)
    except CatalogApplyError as e:
        print(f"error: {e}", file=err)
        return 1
    print(f"catalog {args.file} ({len(catalog.deployments)} deployments) stored in etcd at {result['stored']} "
          f"(revision {result['revision']}); leader {result['leader']} applies it", file=out)
    return 0
