"""
Tests for L{llmgw.control.admin.deploy}: C{PUT} and C{DELETE}
C{/api/v1/deployments/MODEL}, written to the catalog file or to etcd's
catalog, refused as the file is, and only for roles that may change state.
"""

from __future__ import annotations

import json
import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from treq.testing import StubTreq
from twisted.internet import defer
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.admin.api import AdminResource
from llmgw.control.core.catalog import CatalogError, diff, load_catalog
from llmgw.control.ha.member import catalog_key
from llmgw.control.shell.metrics import make_registry
from llmgw.testing.fleet import FakeFleet, sample_fleet
from tests.test_ha import DEMO, EtcdLogCase, Member
from tests.test_login import LoginTestCase

BASE = "http://127.0.0.1:7480"
JSON = {"Content-Type": ["application/json"]}


class FileFleet(FakeFleet):
    """
    A fake fleet whose catalog is a file, reloaded as the reconciler does.
    """

    def __init__(self, path: Path | None):
        super().__init__()
        self.path = path
        self.catalog = load_catalog(path) if path is not None else None

    def status(self) -> dict[str, Any]:
        return {**super().status(), "catalog": str(self.path) if self.path is not None else None}

    def reload_catalog(self) -> dict[str, Any]:
        self.calls.append(("reload",))
        assert self.path is not None and self.catalog is not None
        new = load_catalog(self.path)
        changes, self.catalog = diff(self.catalog, new), new
        return changes


def call(test: SynchronousTestCase, treq: Any, method: str, path: str, body: Any = None,
         headers: dict[str, list[str]] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    d = treq.request(method, BASE + path, headers=headers if headers is not None else JSON, data=data)
    treq.flush()
    response = test.successResultOf(d)
    return response.code, json.loads(test.successResultOf(treq.content(response)))


class FileCase(SynchronousTestCase):
    """
    The admin API over a fake fleet whose catalog is a file in a folder of
    its own.
    """

    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.dir.mkdir()
        self.path = self.dir / "catalog.toml"
        self.path.write_bytes(DEMO)
        os.chmod(self.path, 0o640)
        self.fleet = FileFleet(self.path)
        self.resource = AdminResource(self.fleet, make_registry())
        self.logged: list[dict[str, Any]] = []
        self.resource.log = Logger(observer=self.logged.append)  # type: ignore[arg-type]
        self.treq = StubTreq(self.resource)

    def call(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return call(self, self.treq, method, path, body, **kw)


class FileTests(FileCase):
    def test_put_adds_and_reloads(self) -> None:
        """
        PUT of a new model appends its table to the catalog file, keeping
        the rest of the file and its permissions, leaves no temporary file,
        and reloads the catalog: the answer says what changed.
        """
        code, body = self.call("PUT", "/api/v1/deployments/demo2",
                               {"profile": "fake-1gpu", "min_replicas": 0, "max_replicas": 2})
        self.assertEqual(code, 200, body)
        self.assertEqual((body["model"], body["ok"], body["stored"]), ("demo2", True, str(self.path)))
        self.assertEqual(body["changes"]["added"], ["demo2"])
        text = self.path.read_bytes()
        self.assertTrue(text.startswith(DEMO))
        self.assertEqual(tomllib.loads(text.decode())["deployments"][1],
                         {"model": "demo2", "profile": "fake-1gpu", "min_replicas": 0, "max_replicas": 2})
        self.assertEqual(stat.S_IMODE(os.stat(self.path).st_mode), 0o640)
        self.assertEqual(os.listdir(self.dir), ["catalog.toml"])
        self.assertEqual(self.fleet.calls, [("reload",)])

    def test_failed_write_keeps_the_file(self) -> None:
        """
        When the new file cannot be put in place, the old one stays as it
        was, no temporary file is left, nothing is reloaded, and the answer
        is a 500 (the failure logged).
        """
        def refuse(src: Any, dst: Any) -> None:
            raise OSError(28, "No space left on device")

        self.patch(os, "replace", refuse)
        code, body = self.call("PUT", "/api/v1/deployments/demo2", {"profile": "fake-1gpu"})
        self.assertEqual(code, 500, body)
        self.assertEqual(self.path.read_bytes(), DEMO)
        self.assertEqual(os.listdir(self.dir), ["catalog.toml"])
        self.assertEqual(self.fleet.calls, [])
        failures = [e["log_failure"] for e in self.logged if "log_failure" in e]
        self.assertEqual([f.getErrorMessage() for f in failures], ["[Errno 28] No space left on device"])

    def test_put_changes_in_place(self) -> None:
        """
        PUT of a model the catalog has replaces its table; the change is
        what the reload reports.
        """
        code, body = self.call("PUT", "/api/v1/deployments/demo", {"profile": "fake-1gpu", "replicas": 4})
        self.assertEqual(code, 200, body)
        self.assertEqual(body["changes"]["changed"], ["demo"])
        self.assertEqual(load_catalog(self.path).deployments["demo"].replicas, 4)

    def test_refused_as_the_file_is(self) -> None:
        """
        A bad entry is a 400 whose message is the one the catalog file
        gives the same entry; the file is untouched and nothing reloaded.
        """
        code, body = self.call("PUT", "/api/v1/deployments/demo2", {"profile": "fake-1gpu", "replicas": "two"})
        self.assertEqual(code, 400, body)
        other = self.dir / "other.toml"
        other.write_bytes(DEMO + b'\n[[deployments]]\nmodel = "demo2"\nprofile = "fake-1gpu"\nreplicas = "two"\n')
        with self.assertRaises(CatalogError) as caught:
            load_catalog(other)
        self.assertEqual(f"catalog {str(other)!r}: {body['error']}", str(caught.exception))
        self.assertEqual(self.path.read_bytes(), DEMO)
        self.assertEqual(self.fleet.calls, [])
        code, body = self.call("PUT", "/api/v1/deployments/demo2", {"model": "x", "profile": "fake-1gpu"})
        self.assertEqual((code, body["error"]), (400, "the body's 'model' differs from the path's ('demo2'); "
                                                      "leave it out"))

    def test_delete(self) -> None:
        """
        DELETE removes the model's table and reloads; a model the catalog
        does not have is a 404.
        """
        code, body = self.call("DELETE", "/api/v1/deployments/demo")
        self.assertEqual(code, 200, body)
        self.assertEqual(body["changes"]["removed"], ["demo"])
        self.assertEqual(dict(load_catalog(self.path).deployments), {})
        code, body = self.call("DELETE", "/api/v1/deployments/demo")
        self.assertEqual((code, body["error"]), (404, "the catalog has no deployment 'demo'"))

    def test_slashed_model(self) -> None:
        """
        A model name with a slash, escaped or not, names one deployment.
        """
        code, body = self.call("PUT", "/api/v1/deployments/org%2Fm", {"profile": "fake-1gpu"})
        self.assertEqual((code, body["model"]), (200, "org/m"))
        code, body = self.call("DELETE", "/api/v1/deployments/org/m")
        self.assertEqual((code, body["model"]), (200, "org/m"))

    def test_catalog_view(self) -> None:
        """
        GET /api/v1/catalog lists the profiles (engine, GPUs, whether a
        deployment names a source) and each deployment's table as written,
        which follows a PUT.
        """
        code, body = self.call("GET", "/api/v1/catalog", headers={})
        self.assertEqual(code, 200)
        self.assertEqual(body["profiles"], [{"name": "fake-1gpu", "engine": "generic", "shards": 1, "gpus_per_shard": 1,
                                             "gpu_memory_mb": 1000, "needs_source": False}])
        self.assertEqual(body["deployments"], {"demo": {"model": "demo", "profile": "fake-1gpu", "replicas": 2}})
        self.call("PUT", "/api/v1/deployments/demo", {"profile": "fake-1gpu", "routing": "least_loaded"})
        _, body = self.call("GET", "/api/v1/catalog", headers={})
        self.assertEqual(body["deployments"]["demo"], {"model": "demo", "profile": "fake-1gpu", "routing": "least_loaded"})

    def test_needs_json(self) -> None:
        """
        A PUT that is not application/json is a 415, as a POST is.
        """
        code, _ = self.call("PUT", "/api/v1/deployments/demo", {"profile": "fake-1gpu"}, headers={})
        self.assertEqual(code, 415)

    def test_without_catalog_file(self) -> None:
        """
        A control plane started without --catalog has no file to write: a
        409 that says so.
        """
        resource = AdminResource(FileFleet(None), make_registry())
        resource.log = Logger(observer=lambda e: None)
        code, body = call(self, StubTreq(resource), "PUT", "/api/v1/deployments/d", {"profile": "p"})
        self.assertEqual(code, 409)
        self.assertIn("--catalog", body["error"])


class RoleTests(LoginTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.path = Path(self.mktemp())
        self.path.write_bytes(DEMO)
        self.fleet = FileFleet(self.path)
        self.resource.fleet = self.fleet

    def put(self, cookie: str, csrf: str) -> tuple[int, Any]:
        return call(self, self.treq, "PUT", "/api/v1/deployments/demo2", {"profile": "fake-1gpu"},
                    headers={**JSON, "Cookie": [f"llmgw_session={cookie}"], "X-CSRF-Token": [csrf]})

    def test_viewer_may_not(self) -> None:
        """
        A viewer's PUT and DELETE are 403s, with its own CSRF token or not;
        the file is untouched.
        """
        cookie, csrf = self.login("vera")
        code, body = self.put(cookie, csrf)
        self.assertEqual(code, 403, body)
        self.assertIn("viewer", body["error"])
        code, _ = call(self, self.treq, "DELETE", "/api/v1/deployments/demo",
                       headers={**JSON, "Cookie": [f"llmgw_session={cookie}"], "X-CSRF-Token": [csrf]})
        self.assertEqual(code, 403)
        self.assertEqual(self.path.read_bytes(), DEMO)

    def test_operator_and_admin_may(self) -> None:
        """
        An operator's PUT and an admin's DELETE are done; without the CSRF
        token an operator's PUT is a 403.
        """
        cookie, csrf = self.login("otto")
        self.assertEqual(self.put(cookie, "wrong")[0], 403)
        self.assertEqual(self.put(cookie, csrf)[0], 200)
        cookie, csrf = self.login("ada")
        code, _ = call(self, self.treq, "DELETE", "/api/v1/deployments/demo2",
                       headers={**JSON, "Cookie": [f"llmgw_session={cookie}"], "X-CSRF-Token": [csrf]})
        self.assertEqual(code, 200)
        self.assertEqual(list(load_catalog(self.path).deployments), ["demo"])


class Control:
    def __init__(self, ha: Any):
        self.ha = ha


class HATests(EtcdLogCase):
    def setUp(self) -> None:
        super().setUp()
        self.fake.put(catalog_key("/llmgw"), DEMO)
        self.m = Member(self.reactor, self.fake, "a")
        self.m.ha.startService()
        self.addCleanup(self.m.ha.stopService)
        self.reactor.advance(0.1)
        self.assertTrue(self.m.ha.taken_over)
        self.resource = AdminResource(self.m.cp.fleet, make_registry(), control=Control(self.m.ha))
        self.resource.log = Logger(observer=lambda e: None)
        self.treq = StubTreq(self.resource)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return call(self, self.treq, method, path, body)

    def test_put_stored_in_etcd_and_applied(self) -> None:
        """
        On the leader, PUT stores the changed catalog in etcd (the rest of
        its text kept) and the reconciler runs it at once; the catalog
        watch does not apply it twice.
        """
        code, body = self.call("PUT", "/api/v1/deployments/demo2", {"profile": "fake-1gpu", "replicas": 1})
        self.assertEqual(code, 200, body)
        self.assertEqual(body["changes"]["added"], ["demo2"])
        kv = self.fake.kvs[catalog_key("/llmgw")]
        self.assertTrue(kv.value.startswith(DEMO))
        self.assertIn(f"revision {kv.mod_revision}", body["stored"])
        self.assertEqual(sorted(self.m.reconciler.catalog.deployments), ["demo", "demo2"])
        self.assertEqual(self.m.ha.catalog_revision, kv.mod_revision)
        code, body = self.call("DELETE", "/api/v1/deployments/demo")
        self.assertEqual(code, 200, body)
        self.assertEqual(sorted(self.m.reconciler.catalog.deployments), ["demo2"])
        self.assertNotIn(b'model = "demo"\n', self.fake.kvs[catalog_key("/llmgw")].value)

    def test_refused_leaves_etcd(self) -> None:
        """
        A bad entry is a 400 with the catalog's message; etcd's catalog is
        unchanged.
        """
        before = self.fake.kvs[catalog_key("/llmgw")]
        code, body = self.call("PUT", "/api/v1/deployments/demo", {"profile": "nope"})
        self.assertEqual(code, 400, body)
        self.assertIn("deployment 'demo': field 'profile'", body["error"])
        self.assertEqual(self.fake.kvs[catalog_key("/llmgw")], before)

    def test_concurrent_change_refused(self) -> None:
        """
        When etcd's catalog changes between the read and the write, nothing
        is stored and the answer is a 409 that says to try again.
        """
        real_get = self.fake.get

        def get_then_change(key: bytes) -> defer.Deferred[Any]:
            d = real_get(key)
            self.fake.put(catalog_key("/llmgw"), DEMO.replace(b"replicas = 2", b"replicas = 7"))
            return d

        self.fake.get = get_then_change  # type: ignore[method-assign]
        code, body = self.call("PUT", "/api/v1/deployments/demo2", {"profile": "fake-1gpu"})
        self.assertEqual(code, 409, body)
        self.assertIn("try again", body["error"])
        self.assertNotIn(b"demo2", self.fake.kvs[catalog_key("/llmgw")].value)

    def test_not_leading(self) -> None:
        """
        A member that has not taken over refuses with a 409 (the API sends
        a client on to the leader before it gets there).
        """
        self.m.ha.taken_over = False
        code, body = self.call("PUT", "/api/v1/deployments/demo2", {"profile": "fake-1gpu"})
        self.assertEqual(code, 409, body)


class SampleFleetTests(SynchronousTestCase):
    def test_get_is_405(self) -> None:
        """
        C{/api/v1/deployments/MODEL} takes PUT and DELETE; a GET is a 405
        that lists them.
        """
        resource = AdminResource(sample_fleet(), make_registry())
        resource.log = Logger(observer=lambda e: None)
        code, body = call(self, StubTreq(resource), "GET", "/api/v1/deployments/demo", headers={})
        self.assertEqual(code, 405)
        self.assertIn("PUT or DELETE", body["error"])


class CtlTests(FileCase):
    def ctl(self, *argv: str) -> tuple[int, str, str]:
        import io

        from llmgw.ctl.main import build_parser
        from tests.test_ctl import stub_http

        args = build_parser().parse_args(["ctl", *argv])
        out, err = io.StringIO(), io.StringIO()
        code = args.func(args, out=out, err=err, http=stub_http(self.resource, []), now=0.0)
        return code, out.getvalue(), err.getvalue()

    def test_deploy_and_undeploy(self) -> None:
        """
        C{llmgw ctl deploy} writes the table its options describe (others
        with --set, as JSON or a word); C{ctl undeploy} removes it; a
        refusal is the catalog's message, exit status 1.
        """
        code, out, _ = self.ctl("deploy", "demo2", "--profile", "fake-1gpu", "--min", "0", "--max", "3",
                                "--set", "routing=least_loaded", "--set", "queue_depth=5")
        self.assertEqual((code, out), (0, f"demo2: added in {self.path}\n"))
        self.assertEqual(tomllib.loads(self.path.read_text())["deployments"][1],
                         {"model": "demo2", "profile": "fake-1gpu", "min_replicas": 0, "max_replicas": 3,
                          "routing": "least_loaded", "queue_depth": 5})
        code, _, err = self.ctl("deploy", "demo2", "--profile", "fake-1gpu", "--replicas", "2", "--min", "1")
        self.assertEqual(code, 1)
        self.assertIn("the control plane refused: deployment 'demo2': field 'replicas' fixes the replica count", err)
        code, out, _ = self.ctl("undeploy", "demo2")
        self.assertEqual((code, out), (0, f"demo2: removed from {self.path}; its replicas stop\n"))
        self.assertEqual(list(load_catalog(self.path).deployments), ["demo"])
