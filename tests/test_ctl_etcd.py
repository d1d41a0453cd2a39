"""
C{llmgw ctl token} and C{llmgw ctl user} with C{--etcd}, against one real
etcd member on loopback: what they write is what an HA control plane reads
(L{llmgw.control.ha.sharedtokens}, L{llmgw.control.ha.sharedpeople}), and
the certificates directory's files are left alone. Bounded; skipped when
etcd is not installed.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor
from twisted.trial.unittest import TestCase

from llmgw.control.core.users import verify_password
from llmgw.control.ha.sharedpeople import UserStore
from llmgw.ctl.catalog import SyncEtcd
from llmgw.ctl.etcdkv import SyncKV, result_of
from llmgw.ctl.main import build_parser
from llmgw.testing.etcd import ETCD_MISSING, EtcdCluster
from llmgw.testing.pki import make_pki


class CtlEtcdTests(TestCase):
    skip = ETCD_MISSING
    timeout = 60

    def setUp(self) -> defer.Deferred[None]:
        self.dir = Path(self.mktemp()).resolve()
        make_pki(self.dir, ())
        self.cluster = EtcdCluster(1)
        self.addCleanup(lambda: defer.Deferred.fromCoroutine(self.cluster.stop()))
        return defer.Deferred.fromCoroutine(self.cluster.start(reactor))

    def ctl(self, *argv: str, rc: int = 0) -> tuple[str, str]:
        args: argparse.Namespace = build_parser().parse_args(
            ["ctl", *argv, "--etcd", ",".join(self.cluster.urls), "--etcd-prefix", "/t"])
        out, err = io.StringIO(), io.StringIO()
        self.assertEqual(args.func(args, out=out, err=err), rc, err.getvalue())
        return out.getvalue(), err.getvalue()

    def password(self, text: str) -> str:
        path = Path(self.mktemp())
        path.write_text(text + "\n")
        return str(path)

    def test_tokens(self) -> None:
        """A token created, listed and revoked in etcd, nothing in the certificates directory; an unknown id is an error."""
        token = self.ctl("token", "create", "--certs", str(self.dir), "--uses", "4")[0].strip()
        tid = token.split(".")[1]
        listed: list[dict[str, Any]] = json.loads(self.ctl("token", "list", "--json")[0])
        self.assertEqual([(t["id"], t["uses"], t["state"]) for t in listed], [(tid, 4, "valid")])
        self.ctl("token", "revoke", tid)
        self.assertEqual(json.loads(self.ctl("token", "list", "--json")[0])[0]["state"], "revoked")
        _, err = self.ctl("token", "revoke", "00000000", rc=1)
        self.assertIn("no token '00000000'", err)
        self.assertFalse((self.dir / "join-tokens.json").exists())

    def test_users(self) -> None:
        """A user added, given a new password and removed in etcd; a name taken twice and an unknown one are errors."""
        self.ctl("user", "add", "ann", "--role", "operator", "--password-file", self.password("first-password"))
        _, err = self.ctl("user", "add", "ann", "--role", "viewer", "--password-file", self.password("x" * 9), rc=2)
        self.assertIn("exists", err)
        self.assertEqual(json.loads(self.ctl("user", "list", "--json")[0]), [{"name": "ann", "role": "operator"}])
        self.ctl("user", "passwd", "ann", "--password-file", self.password("second-password"))
        user = result_of(UserStore(SyncKV(SyncEtcd(self.cluster.urls)), "/t").get("ann"))
        assert user is not None
        self.assertTrue(verify_password(user, "second-password"))
        self.ctl("user", "remove", "ann")
        _, err = self.ctl("user", "remove", "ann", rc=1)
        self.assertIn("no user 'ann'", err)
        self.assertFalse((self.dir / "users.json").exists())

