"""
End to end, on loopback: a real etcd, three
real control-plane members (C{twistd llmgw control --etcd ...}) each with
its embedded gateway, and one real agent running a fake-model shard. The
gateways of the members that do not lead answer a chat completion through
the shard, from the routing table the leader published in etcd; after the
leader is killed (-9) they still do, and a member that does not lead
answers C{GET /api/v1/routes} itself. Bounded; skipped when etcd is not
installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import treq
from twisted.internet import defer, reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from llmgw.testing.etcd import ETCD_MISSING, EtcdCluster
from llmgw.testing.pki import make_pki
from llmgw.testing.procs import free_port
from tests import test_ha_e2e as base

NODE = "node-1"


class HARoutesEndToEndTests(TestCase):
    skip = ETCD_MISSING
    timeout = 150

    _cleanup = base.HAEndToEndTests._cleanup
    cleanup = base.HAEndToEndTests.cleanup
    get = base.HAEndToEndTests.get
    statuses = base.HAEndToEndTests.statuses
    wait = base.HAEndToEndTests.wait
    tail = staticmethod(base.HAEndToEndTests.tail)
    shard_pids = base.HAEndToEndTests.shard_pids

    def setUp(self) -> defer.Deferred[None]:
        self.dir = Path(self.mktemp()).resolve()
        make_pki(self.dir, [NODE], ["127.0.0.1"])
        self.states = {NODE: Path(self.mktemp()).resolve()}
        self.members: dict[str, base.Proc] = {}
        self.admin: dict[str, str] = {}
        self.gateway: dict[str, str] = {}
        self.agents: list[base.Proc] = []
        self.cluster = EtcdCluster(1)
        self.addCleanup(self.cleanup)
        return defer.Deferred.fromCoroutine(self.cluster.start(reactor))

    def catalog(self) -> Path:
        path = base.HAEndToEndTests.catalog(self)  # type: ignore[arg-type]
        path.write_text(path.read_text().replace("replicas = 3", "replicas = 1"))
        return path

    def start(self) -> None:
        catalog = self.catalog()
        agents = {m: free_port() for m in base.MEMBERS}
        for m in base.MEMBERS:
            self.admin[m] = f"http://127.0.0.1:{free_port()}"
            self.gateway[m] = f"http://127.0.0.1:{free_port()}"
            p = base.Proc(m, base.twistd(
                "control", "--certs", str(self.dir), "--agent-listen", f"127.0.0.1:{agents[m]}",
                "--admin", self.admin[m].removeprefix("http://"),
                "--gateway", self.gateway[m].removeprefix("http://"), "--catalog", str(catalog),
                "--heartbeat", str(base.HEARTBEAT), "--pass-interval", "0.2",
                "--adoption-grace", "2", "--etcd", ",".join(self.cluster.urls),
                "--etcd-ttl", str(base.TTL), "--member-id", m, "--advertise-admin", self.admin[m],
            ))
            p.start()
            self.members[m] = p
        args = ["agent"]
        for m in base.MEMBERS:
            args += ["--control", f"127.0.0.1:{agents[m]}"]
        args += ["--certs", str(self.dir), "--node", NODE, "--gpus", "sim:1x24GiB",
                 "--state-dir", str(self.states[NODE]), "--heartbeat", str(base.HEARTBEAT)]
        agent = base.Proc(NODE, base.twistd(*args))
        agent.start()
        self.agents.append(agent)

    async def leader(self, exclude: tuple[str, ...] = ()) -> str | None:
        """The leader, once every live member names it and its agent is on it."""
        sts = {m: st for m, st in (await self.statuses()).items() if m not in exclude}
        leaders = [m for m, st in sts.items() if st.get("role") == "leader"]
        live = [m for m, p in self.members.items() if p.alive and m not in exclude]
        if len(leaders) != 1 or len(sts) != len(live):
            return None
        if not all(st.get("leader_id") == leaders[0] for st in sts.values()):
            return None
        return leaders[0] if sts[leaders[0]].get("agents_connected") == 1 else None

    async def chat(self, member: str) -> int | None:
        """A chat completion through C{member}'s embedded gateway: its status."""
        body = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        try:
            r = await treq.post(self.gateway[member] + "/v1/chat/completions",
                                data=json.dumps(body).encode(),
                                headers={b"content-type": [b"application/json"]},
                                timeout=5.0, persistent=False)
            await r.content()
            return int(r.code)
        except Exception:  # noqa: BLE001 - not up yet: no answer
            return None

    async def chats(self, member: str) -> bool:
        return await self.chat(member) == 200

    async def followed_nodes(self, member: str) -> dict[str, Any] | None:
        """C{GET /api/v1/nodes} on C{member}, when answered there (200) and listing L{NODE}."""
        r = await treq.get(self.admin[member] + "/api/v1/nodes", allow_redirects=False,
                           timeout=5.0, persistent=False)
        body = await r.json()
        if r.code == 200 and NODE in [n["id"] for n in body.get("nodes", [])]:
            return body  # type: ignore[no-any-return]
        return None

    def test_followers_gateways_serve_through_a_failover(self) -> Any:
        """
        Both followers' gateways answer a chat through the shard; the
        leader is killed (-9); before and after a new leader is elected the
        remaining follower's gateway answers, its admin API answers the
        routes and the nodes (listing the agent, published by the new
        leader) itself (no redirect), and the shard process is the same.
        """
        async def go() -> None:
            self.start()
            leader = await self.wait("a leader with the agent", self.leader, timeout=60)
            followers = [m for m in base.MEMBERS if m != leader]
            for f in followers:
                await self.wait(f"a chat through follower {f}'s gateway", lambda f=f: self.chats(f))
            pids = self.shard_pids()
            self.assertEqual(len(pids), 1)

            self.members[leader].signal("KILL")
            await self.members[leader].out.ended
            # At once, before anyone has taken over: the followers' last tables.
            for f in followers:
                self.assertEqual(await self.chat(f), 200, f"follower {f} with the leader gone")
            second = await self.wait("a new leader with the agent",
                                     lambda: self.leader(exclude=(leader,)), timeout=60)
            other = next(f for f in followers if f != second)
            # Past the new leader's adoption grace (2 s): its own table, followed.
            await deferLater(reactor, 3.0, lambda: None)
            self.assertEqual(await self.chat(other), 200, f"follower {other} after the failover")
            r = await treq.get(self.admin[other] + "/api/v1/routes", allow_redirects=False,
                               timeout=5.0, persistent=False)
            routes = await r.json()
            self.assertEqual(r.code, 200, routes)
            self.assertEqual([x["model"] for x in routes["routes"]], ["demo"])
            # And the nodes, from the fleet views the new leader published.
            nodes = await self.wait(f"follower {other} answering the nodes with {NODE}",
                                    lambda: self.followed_nodes(other))
            self.assertEqual(nodes["published_by"], second)
            self.assertEqual(self.shard_pids(), pids)

        return defer.Deferred.fromCoroutine(go())
