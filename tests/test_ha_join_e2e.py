"""
Joining and logging in on an HA control plane, end to end on loopback: a
real 3-member etcd, three real control-plane members (C{twistd llmgw
control --etcd ... --join-listen PORT --signer --admin-tls}) and agents
that join (C{twistd llmgw agent --join ... --control ...} for every
member). A token and a user are made with C{llmgw ctl ... --etcd}; agents
join through the leader and a follower; the leader is killed (-9); another
agent joins with the same token through the new leader and the uses are
counted right; the used-up token is refused on every member left; the user
logs in after the failover, and the session opened before it still holds.
A second case: a follower refuses a name a node connected to the leader
holds, and an agent given every member's join listener joins while the
first it names is down.

Bounded: every wait has a deadline and every process started is killed in
cleanup (the base case's). Skipped when etcd is not installed.
"""

from __future__ import annotations

import argparse
import io
import json
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import treq
from twisted.internet import defer, reactor, threads
from twisted.internet.error import ProcessTerminated
from twisted.internet.task import deferLater
from twisted.web.client import Agent, HTTPConnectionPool

from llmgw.ctl.main import build_parser
from llmgw.testing.procs import free_port
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.options import ClientTLSPolicy, TLSFiles
from tests import test_ha_e2e as base
from tests.test_login_tls import BrowserPolicy

MEMBERS = base.MEMBERS


class HAJoinEndToEndTests(base.HAProcessCase):
    timeout = 240
    shard_states = False

    wait = base.HAEndToEndTests.wait
    tail = base.HAEndToEndTests.tail

    def setUp(self) -> defer.Deferred[None]:
        d = super().setUp()
        CertificateAuthority.load(self.dir).issue_admin("olga", "operator")
        self.join_ports: dict[str, int] = {}
        return d

    # -- helpers ------------------------------------------------------------------------------

    async def ctl(self, *argv: str, stdin: str | None = None) -> str:
        """C{llmgw ctl ...} against etcd, in a thread (it blocks); its output, or a failure."""
        def run() -> tuple[int, str, str]:
            args: argparse.Namespace = build_parser().parse_args(["ctl", *argv])
            out, err = io.StringIO(), io.StringIO()
            return args.func(args, out=out, err=err), out.getvalue(), err.getvalue()

        rc, out, err = await threads.deferToThread(run)
        if rc != 0:
            raise AssertionError(f"llmgw ctl {' '.join(argv)} exited {rc}: {err}")
        return out

    def etcd_args(self) -> list[str]:
        return ["--etcd", ",".join(self.cluster.urls)]

    def client(self, policy: Any) -> Any:
        return treq.client.HTTPClient(Agent(reactor, contextFactory=policy,
                                            pool=HTTPConnectionPool(reactor, persistent=False)))

    def tool(self) -> Any:
        d = self.dir
        return self.client(ClientTLSPolicy(TLSFiles.load(d / "ca.pem", d / "admin-olga.pem", d / "admin-olga.key")))

    def browser(self) -> Any:
        return self.client(BrowserPolicy((self.dir / "ca.pem").read_bytes()))

    async def call(self, client: Any, member: str, method: str, path: str, body: Any = None,
                   headers: dict[str, list[str]] | None = None) -> tuple[int, Any, Any]:
        headers = dict(headers or {})
        data = None
        if method == "POST":
            headers["Content-Type"] = ["application/json"]
            data = json.dumps(body or {}).encode()
        d = client.request(method, self.admin[member] + path, headers=headers, data=data)
        d.addTimeout(5, reactor)
        r = await d
        content = await treq.content(r)
        return r.code, (json.loads(content) if content.startswith(b"{") else content), r

    async def statuses(self) -> dict[str, Any]:
        out = {}
        for m, p in self.members.items():
            if p.alive:
                try:
                    code, st, _ = await self.call(self.tool(), m, "GET", "/api/v1/status")
                except Exception:  # noqa: BLE001 - starting or dead: no answer
                    continue
                if code == 200:
                    out[m] = st
        return out

    async def leader(self, agents: int = 0) -> str | None:
        """The leader every live member names, once C{agents} agents are on it."""
        sts = await self.statuses()
        live = [m for m, p in self.members.items() if p.alive]
        leaders = [m for m, st in sts.items() if st.get("role") == "leader"]
        if len(sts) != len(live) or len(leaders) != 1:
            return None
        if not all(st.get("leader_id") == leaders[0] for st in sts.values()):
            return None
        return leaders[0] if sts[leaders[0]].get("agents_connected", 0) >= agents else None

    def start_members(self) -> None:
        for m in MEMBERS:
            admin, agent, join = free_port(), free_port(), free_port()
            self.admin[m] = f"https://127.0.0.1:{admin}"
            self.join_ports[m] = join
            self.agent_ports = getattr(self, "agent_ports", {})
            self.agent_ports[m] = agent
            p = base.Proc(m, base.twistd(
                "control", "--certs", str(self.dir), "--agent-listen", f"127.0.0.1:{agent}",
                "--join-listen", f"127.0.0.1:{join}", "--signer",
                "--admin", f"127.0.0.1:{admin}", "--admin-tls", "--gateway", "off",
                "--heartbeat", str(base.HEARTBEAT), "--adoption-grace", "0",
                "--etcd", ",".join(self.cluster.urls), "--etcd-ttl", str(base.TTL), "--member-id", m,
                "--advertise-admin", self.admin[m],
            ))
            p.start()
            self.members[m] = p

    def agent(self, node: str, token: str, *members: str) -> base.Proc:
        """An agent that joins at C{members}' join listeners, in that order, and dials every member."""
        joins = ",".join(f"127.0.0.1:{self.join_ports[m]}" for m in members)
        args = ["agent", "--join", joins, "--token", token, "--node", node]
        for m in MEMBERS:
            args += ["--control", f"127.0.0.1:{self.agent_ports[m]}"]
        args += ["--gpus", "sim:1x24GiB", "--state-dir", str(Path(self.mktemp()).resolve()),
                 "--heartbeat", str(base.HEARTBEAT)]
        p = base.Proc(node, base.twistd(*args))
        p.start()
        self.agents.append(p)
        return p

    async def login(self, member: str) -> tuple[dict[str, list[str]], Any]:
        code, body, r = await self.call(self.browser(), member, "POST", "/api/v1/login",
                                        {"user": "ann", "password": "ann-password-1"})
        self.assertEqual(code, 200, body)
        cookie: SimpleCookie = SimpleCookie()
        cookie.load(r.headers.getRawHeaders(b"set-cookie")[0].decode())
        return {"Cookie": [f"llmgw_session={cookie['llmgw_session'].value}"]}, body

    async def tokens(self) -> list[dict[str, Any]]:
        listed: list[dict[str, Any]] = json.loads(await self.ctl("token", "list", "--json", *self.etcd_args()))
        return listed

    async def refused(self, agent: base.Proc) -> str:
        """The output of an agent that stops with status 2 (a refused join)."""
        deadline = reactor.seconds() + 60
        while agent.alive:
            if reactor.seconds() > deadline:
                self.fail(f"{agent.name} did not stop:\n{agent.out.text()[-3000:]}")
            await deferLater(reactor, 0.1, lambda: None)
        reason = await agent.out.ended
        self.assertIsInstance(reason, ProcessTerminated, agent.out.text()[-2000:])
        self.assertEqual(reason.exitCode, 2, agent.out.text()[-2000:])
        return agent.out.text()

    # -- the test -----------------------------------------------------------------------------

    def test_join_and_login_across_failover(self) -> Any:
        """
        A token of three uses and a user made in etcd; two agents join
        through the leader and a follower; after kill -9 of the leader a
        third joins through the new leader, the token shows 3/3 with the
        three nodes, a fourth join is refused as used up on both members
        left; the user logs in on the new leader, and the session opened
        on the old leader still reads there.
        """
        async def go() -> None:
            self.start_members()
            first = await self.wait("a leader every member names", self.leader)
            follower = next(m for m in MEMBERS if m != first)
            password = Path(self.mktemp())
            password.write_text("ann-password-1\n")
            await self.ctl("user", "add", "ann", "--role", "viewer", "--password-file", str(password),
                           *self.etcd_args())
            token = (await self.ctl("token", "create", "--certs", str(self.dir), "--uses", "3",
                                    *self.etcd_args())).strip()
            self.agent("node-1", token, first)
            self.agent("node-2", token, follower)
            await self.wait("two joined agents on the leader", lambda: self.leader(agents=2))
            before, _ = await self.login(first)

            self.members[first].signal("KILL")
            await self.members[first].out.ended
            second = await self.wait("a new leader with both agents", lambda: self.leader(agents=2))
            self.assertNotEqual(second, first)

            self.agent("node-3", token, second)
            await self.wait("three agents on the new leader", lambda: self.leader(agents=3))
            [listed] = await self.tokens()
            self.assertEqual((listed["used"], listed["uses"], listed["state"]), (3, 3, "used up"))
            self.assertEqual(sorted(listed["nodes"]), ["node-1", "node-2", "node-3"])
            self.assertIn("node node-3 joined from 127.0.0.1:", self.members[second].out.text())
            self.assertIn("(kept in etcd)", self.members[follower].out.text())
            for i, m in enumerate(m for m in MEMBERS if m != first):
                text = await self.refused(self.agent(f"node-{4 + i}", token, m))
                self.assertIn("is used up", text)

            code, body, _ = await self.call(self.browser(), second, "GET", "/api/v1/nodes", headers=before)
            self.assertEqual(code, 200, body)
            self.assertEqual(len([n for n in body["nodes"] if n["connected"]]), 3)
            people = (await self.statuses())[second]["ha"]["people"]
            self.assertEqual((people["users"], people["etcd_error"]), (1, ""))
            after, answer = await self.login(second)
            self.assertEqual(answer["role"], "viewer")
            code, body, _ = await self.call(self.browser(), second, "GET", "/api/v1/whoami", headers=after)
            self.assertEqual(code, 200, body)

        return defer.Deferred.fromCoroutine(go())

    async def follower_sees(self, member: str, node: str) -> bool:
        """Whether C{member}'s nodes view (the leader's published one) lists C{node} connected."""
        try:
            code, body, _ = await self.call(self.tool(), member, "GET", "/api/v1/nodes")
        except Exception:  # noqa: BLE001 - not answering yet
            return False
        return code == 200 and any(n["id"] == node and n["connected"] for n in body.get("nodes", []))

    def test_follower_sees_the_fleet_and_joins_try_every_member(self) -> None:
        """
        A node joins and connects to the leader; once a follower's view
        lists it, a second node asking that follower for the same name is
        refused (status 2, "is connected now"), logged by the follower
        with its address, and no use is spent for it. Then a follower is
        killed (-9), and an agent given the dead member's join listener
        first and the others after joins and connects.
        """
        async def go() -> None:
            self.start_members()
            leader = await self.wait("a leader every member names", self.leader)
            followers = [m for m in MEMBERS if m != leader]
            token = (await self.ctl("token", "create", "--certs", str(self.dir), "--uses", "3",
                                    *self.etcd_args())).strip()
            self.agent("node-1", token, leader)
            await self.wait("node-1 on the leader", lambda: self.leader(agents=1))
            await self.wait("node-1 in a follower's view", lambda: self.follower_sees(followers[0], "node-1"))

            clash = self.agent("node-1", token, followers[0])
            text = await self.refused(clash)
            self.agents.remove(clash)  # ended (reaped): the waits below watch the agents that run
            self.assertIn("is connected now: another node holds that name", text)
            self.assertIn("join refused for node node-1 from 127.0.0.1:", self.members[followers[0]].out.text())
            [listed] = await self.tokens()
            self.assertEqual((listed["used"], listed["nodes"]), (1, ["node-1"]))

            dead = followers[1]
            self.members[dead].signal("KILL")
            await self.members[dead].out.ended
            joined = self.agent("node-2", token, dead, followers[0], leader)
            await self.wait("node-2 on the leader", lambda: self.leader(agents=2))
            self.assertIn(f"cannot join at 127.0.0.1:{self.join_ports[dead]}", joined.out.text())
            [listed] = await self.tokens()
            self.assertEqual(sorted(listed["nodes"]), ["node-1", "node-2"])

        return defer.Deferred.fromCoroutine(go())
