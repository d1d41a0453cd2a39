"""
What C{llmgw ctl token} and C{llmgw ctl user} need of etcd with C{--etcd}:
the options (as C{ctl catalog apply} takes them), and L{SyncKV}, the calls
of L{llmgw.etcd.EtcdClient} that the stores in L{llmgw.control.ha} make
(get, range, delete, txn), answered over etcd's JSON gateway with the
standard library and returned as Deferreds that have already fired. So the
CLI runs the very code the control plane runs, with no reactor.
"""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Sequence
from typing import Any, TypeVar

from twisted.internet import defer
from twisted.python.failure import Failure

from llmgw.ctl.catalog import CatalogApplyError, SyncEtcd
from llmgw.etcd import Compare, EtcdError, EtcdUnavailable, KeyValue, Op, TxnResult, b64

T = TypeVar("T")

#: The environment variable C{--etcd} defaults to.
ETCD_ENV = "LLMGW_ETCD"


def add_etcd_arguments(p: argparse.ArgumentParser) -> None:
    """C{--etcd} and its companions; without C{--etcd} nothing changes."""
    p.add_argument("--etcd", default=argparse.SUPPRESS, metavar="URLS",
                   help="comma-separated etcd client URLs of an HA control plane: act on what it keeps "
                   f"in etcd, not on the certificates directory (default ${ETCD_ENV})")
    p.add_argument("--etcd-ca", default=argparse.SUPPRESS, help="CA bundle of etcd's server certificates (https)")
    p.add_argument("--etcd-cert", default=argparse.SUPPRESS, help="client certificate for etcd (https)")
    p.add_argument("--etcd-key", default=argparse.SUPPRESS, help="the key of --etcd-cert")
    p.add_argument("--etcd-prefix", default=argparse.SUPPRESS,
                   help="key prefix of the control plane's state in etcd (default /llmgw)")


def etcd_of(args: argparse.Namespace) -> tuple[SyncKV, str] | None:
    """The etcd C{args} name and the prefix, or None without C{--etcd}."""
    urls_text = getattr(args, "etcd", None) or os.environ.get(ETCD_ENV)
    if not urls_text:
        return None
    ca, cert, key = (getattr(args, n, None) for n in ("etcd_ca", "etcd_cert", "etcd_key"))
    context = None
    if ca or cert:
        context = ssl.create_default_context(cafile=ca)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if cert:
            context.load_cert_chain(cert, key)
    urls = [u.strip().rstrip("/") for u in urls_text.split(",") if u.strip()]
    prefix = (getattr(args, "etcd_prefix", None) or "/llmgw").rstrip("/")
    return SyncKV(SyncEtcd(urls, context)), prefix


def result_of(d: defer.Deferred[T]) -> T:
    """
    The result of a Deferred that has fired (as every one made over
    L{SyncKV} has); its failure raised.
    """
    box: list[Any] = []
    d.addBoth(box.append)
    if not box:
        raise RuntimeError("an etcd call over SyncKV did not complete at once")
    if isinstance(box[0], Failure):
        box[0].raiseException()
    result: T = box[0]
    return result


class SyncKV:
    """The calls the HA stores make, over L{SyncEtcd}; see the module docstring."""

    def __init__(self, etcd: SyncEtcd):
        self.etcd = etcd

    def _call(self, path: str, body: dict[str, Any]) -> defer.Deferred[dict[str, Any]]:
        try:
            return defer.succeed(self.etcd.call(path, body))
        except CatalogApplyError as e:
            return defer.fail(EtcdUnavailable(str(e)))

    def range(self, key: bytes, range_end: bytes = b"") -> defer.Deferred[tuple[list[KeyValue], int]]:
        body = {"key": b64(key)}
        if range_end:
            body["range_end"] = b64(range_end)
        return self._call("/kv/range", body).addCallback(
            lambda a: ([KeyValue.from_json(kv) for kv in a.get("kvs", [])], int(a["header"]["revision"])))

    def get(self, key: bytes) -> defer.Deferred[KeyValue | None]:
        return self.range(key).addCallback(lambda found: found[0][0] if found[0] else None)

    def delete(self, key: bytes, range_end: bytes = b"") -> defer.Deferred[int]:
        body = {"key": b64(key)}
        if range_end:
            body["range_end"] = b64(range_end)
        return self._call("/kv/deleterange", body).addCallback(lambda a: int(a.get("deleted", 0)))

    def txn(self, compare: Sequence[Compare], success: Sequence[Op],
            failure: Sequence[Op] = ()) -> defer.Deferred[TxnResult]:
        def read(a: dict[str, Any]) -> TxnResult:
            if "header" not in a:
                raise EtcdError(-1, f"an answer without a header: {str(a)[:200]}")
            return TxnResult(bool(a.get("succeeded", False)), int(a["header"]["revision"]),
                             a.get("responses", []))

        return self._call("/kv/txn", {
            "compare": [c.to_json() for c in compare],
            "success": [op.to_json() for op in success],
            "failure": [op.to_json() for op in failure],
        }).addCallback(read)

