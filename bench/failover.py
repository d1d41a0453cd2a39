"""
Failover of an HA control plane on etcd: repeated kill -9 of the
leader with many simulated agents connected.

What runs, all on 127.0.0.1:

* one etcd member (Debian's C{etcd}, on free ports, its own data dir);
* three control-plane members, each a real C{twistd -n llmgw control --etcd
  ...} process (C{--insecure}: plain TCP on loopback, so that the agents'
  TLS handshakes do not dominate a 2-CPU machine; the election, redirects
  and adoption are the same), with a catalog of one deployment with as many
  one-GPU replicas as there are agents, and C{--adoption-grace};
* N simulated agents in this process speaking the real agent stream: each
  knows the three members' addresses, follows redirects at once (as the
  agent does), reports the shards it runs in every Register, answers
  C{StartShard} with a READY C{ShardStatus}, and sends heartbeats. Before
  each kill every agent gets one more shard that nothing claims (a stray,
  as a crashed placement leaves), which it reports in its next Register:
  stopping what nobody claims is a command adoption allows at once, so a
  command is due to every agent as soon as the new leader has it, and the
  leader's first command dispatched is the earliest C{StopShard} any agent
  receives.

Once every replica is ready, the leader is killed with SIGKILL, K times. For
each kill, measured on the agents' side from the moment of the kill: the
new leader's first accepted Register, all N agents registered with it, its
first command received by any agent (the earliest StopShard of a stray),
and every stray stopped. A watch on the leader key in etcd, in this process,
splits the time to the first command: the old lease expiring (the key's
DELETE), the new leader's win (its PUT), then its first command.
After each kill the dead member is started again (as a follower) before
the next one. The baseline, measured in the same run with the same agents'
code: one standalone control plane (no etcd), killed the same way and
restarted at once, which is the best recovery without HA. Shards restarted (a C{StartShard} for a replica an agent
already runs, or any C{StopShard} of a claimed shard) and duplicates (two
agents running the same replica, or the leader listing more replicas than
declared) must both be 0.

    python bench/failover.py                 # 20 kills (baseline 5), 1,000 agents, TTL 5 s
    python bench/failover.py --kills 3 --agents 200

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from twisted.internet import defer, task  # noqa: E402
from twisted.internet.protocol import ClientFactory  # noqa: E402
from twisted.python.failure import Failure  # noqa: E402

from bench.common import raise_nofile, summary_ms  # noqa: E402
from llmgw.api.v1 import agent_pb2 as pb  # noqa: E402
from llmgw.testing.etcd import ETCD_MISSING, EtcdCluster  # noqa: E402
from llmgw.testing.procs import ProcessOutput, free_port  # noqa: E402
from llmgw.wire import PROTOCOL_VERSION, MessageStream, parse_redirect  # noqa: E402

CATALOG = """
[ports]
first = 20000
last = 20999

[profiles.sim]
shards = 1
gpus_per_shard = 1
gpu_memory_mb = 1000
fabric = ""
command = ["/bin/true", "{{port}}"]
env = {{}}
health_path = "/health"
startup_timeout_s = 60
drain_timeout_s = 10
stop_grace_s = 5

[[deployments]]
model = "sim"
profile = "sim"
replicas = {replicas}
"""



def stray_id(node_id: str) -> str:
    return f"stray-{node_id}"


class Node:
    def __init__(self, bench: Bench, node_id: str):
        self.bench = bench
        self.node_id = node_id
        self.target = 0
        self.redirect: str | None = None
        self.stream: Stream | None = None
        self.registered_with: str | None = None
        #: shard id -> RunningShard (what this node runs).
        self.shards: dict[str, pb.RunningShard] = {}
        #: Reports a shard nothing claims in its next Register (the
        #: command due at once from a new leader).
        self.stray = False

    def register(self) -> bytes:
        running = list(self.shards.values())
        if self.stray:
            sid = stray_id(self.node_id)
            running.append(pb.RunningShard(
                shard_id=sid, replica_id=sid, model="gone", profile="sim",
                gpu_indices=[0], port=20999, state=pb.ShardStatus.STATE_READY,
            ))
        return pb.AgentMessage(register=pb.Register(
            protocol_version=PROTOCOL_VERSION, node_id=self.node_id, agent_version="bench",
            gpus=[pb.GPU(index=0, uuid=f"GPU-{self.node_id}", name="Sim", memory_total_mb=80_000)],
            running_shards=running,
        )).SerializeToString()

    def dial(self) -> None:
        address = self.redirect or self.bench.controls[self.target]
        host, port = address.rsplit(":", 1)
        self.bench.reactor.connectTCP(host, int(port), Factory(self, address), timeout=5)

    def lost(self, redirected: bool) -> None:
        self.stream = None
        self.registered_with = None
        if redirected:
            delay = 0.0
        else:
            self.redirect = None
            self.target = (self.target + 1) % len(self.bench.controls)
            delay = 1.0 + random.random()
        if self.bench.running:
            self.bench.reactor.callLater(delay, self.dial)


class Stream(MessageStream[pb.ControlMessage]):
    incoming = pb.ControlMessage

    def __init__(self, node: Node, address: str):
        self.node = node
        self.address = address
        self.redirected = False

    def connectionMade(self) -> None:
        self.node.stream = self
        self.sendString(self.node.register())

    def message_received(self, msg: pb.ControlMessage) -> None:
        node, bench = self.node, self.node.bench
        kind = msg.WhichOneof("msg")
        if kind == "ack":
            if msg.ack.message_id == "register":
                if msg.ack.ok:
                    node.registered_with = self.address
                    bench.registered(node, self.address)
                else:
                    leader = parse_redirect(msg.ack.error)
                    if leader is not None:
                        node.redirect = leader
                        self.redirected = True
                    self.transport.loseConnection()
        elif kind == "start":
            s = msg.start
            # After the first placement every replica exists: a start during
            # a failover, of a shard already running, or of a replica placed
            # elsewhere is a restart.
            elsewhere = bench.placed_replicas.get(s.replica_id, node.node_id) != node.node_id
            if bench.phase == "failover" or s.shard_id in node.shards or elsewhere:
                bench.restarts += 1
            bench.placed_replicas[s.replica_id] = node.node_id
            node.shards[s.shard_id] = pb.RunningShard(
                shard_id=s.shard_id, replica_id=s.replica_id, model=s.model, profile=s.profile,
                rank=s.rank, gpu_indices=list(s.gpu_indices), port=s.port,
                state=pb.ShardStatus.STATE_READY,
            )
            self.sendString(pb.AgentMessage(shard=pb.ShardStatus(
                replica_id=s.replica_id, shard_id=s.shard_id, state=pb.ShardStatus.STATE_READY,
            )).SerializeToString())
        elif kind == "stop":
            shard_id = msg.stop.shard_id
            if node.stray and shard_id == stray_id(node.node_id):
                bench.command_received(self.address)
                node.stray = False
            elif shard_id in node.shards:
                bench.stops_of_claimed += 1
                rs = node.shards.pop(shard_id)
                self.sendString(pb.AgentMessage(shard=pb.ShardStatus(
                    replica_id=rs.replica_id, shard_id=shard_id, state=pb.ShardStatus.STATE_STOPPED,
                )).SerializeToString())

    def frame_refused(self, reason: str) -> None:
        pass

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        self.node.lost(self.redirected)


class Factory(ClientFactory):
    noisy = False

    def __init__(self, node: Node, address: str):
        self.node = node
        self.address = address

    def buildProtocol(self, addr: Any) -> Stream:
        return Stream(self.node, self.address)

    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:
        self.node.lost(False)


class Member:
    def __init__(self, name: str, args: list[str], log_path: Path):
        self.name = name
        self.args = args
        self.log_path = log_path
        self.out = ProcessOutput()
        self.proc: Any = None

    def start(self, reactor: Any) -> None:
        self.out = ProcessOutput()
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = reactor.spawnProcess(self.out, sys.executable, self.args, env=env, path=str(ROOT))

    @property
    def alive(self) -> bool:
        return self.proc is not None and not self.out.ended.called


class Bench:
    def __init__(self, reactor: Any, agents: int, ttl: int, grace: float, heartbeat: float, ha: bool = True):
        self.reactor = reactor
        #: False: the baseline, one standalone control plane restarted at
        #: once after each kill (the best an operator can do today).
        self.ha = ha
        self.n = agents
        self.ttl = ttl
        self.grace = grace
        self.heartbeat = heartbeat
        self.controls: list[str] = []
        self.admin: list[str] = []
        self.members: list[Member] = []
        self.nodes = [Node(self, f"sim-{i:05d}") for i in range(agents)]
        self.running = True
        self.phase = "setup"
        self.restarts = 0
        self.stops_of_claimed = 0
        self.placed_replicas: dict[str, str] = {}
        self.on_leader: dict[str, set[str]] = {}
        self.t_kill = 0.0
        self.t_first_register: float | None = None
        self.t_all: float | None = None
        self.t_first_command: float | None = None
        self.t_all_strays: float | None = None
        self.strays_stopped = 0
        #: From the watch on the leader key: the old leader's key gone (its
        #: lease expired) and the new leader's key put (it won).
        self.t_key_deleted: float | None = None
        self.t_key_put: float | None = None
        self.new_leader: str | None = None
        self.killed: str | None = None

    # -- agent-side observations ---------------------------------------------

    def registered(self, node: Node, address: str) -> None:
        now = time.monotonic()
        self.on_leader.setdefault(address, set()).add(node.node_id)
        if self.phase != "failover" or (self.ha and address == self.killed):
            return
        if self.t_first_register is None:
            self.t_first_register = now
            self.new_leader = address
        if len(self.on_leader[address]) == self.n and self.t_all is None:
            self.t_all = now

    def command_received(self, address: str) -> None:
        if self.phase != "failover" or (self.ha and address == self.killed):
            return
        now = time.monotonic()
        if self.t_first_command is None:
            self.t_first_command = now
        self.strays_stopped += 1
        if self.strays_stopped == self.n:
            self.t_all_strays = now

    def leader_key_events(self, events: list[Any], revision: int) -> None:
        if self.phase != "failover":
            return
        now = time.monotonic()
        for ev in events:
            if ev.kind == "DELETE" and self.t_key_deleted is None:
                self.t_key_deleted = now
            elif ev.kind == "PUT" and self.t_key_put is None:
                self.t_key_put = now

    def heartbeats(self) -> None:
        msg = pb.AgentMessage(heartbeat=pb.Heartbeat(gpu_memory_used_mb=[0])).SerializeToString()
        for node in self.nodes:
            if node.stream is not None and node.registered_with is not None:
                node.stream.sendString(msg)

    # -- the control plane -----------------------------------------------------

    def start_members(self, work: Path, etcd_urls: list[str]) -> None:
        catalog = work / "catalog.toml"
        catalog.write_text(CATALOG.format(replicas=self.n))
        for i in range(3 if self.ha else 1):
            port, admin = free_port(), free_port()
            self.controls.append(f"127.0.0.1:{port}")
            self.admin.append(f"http://127.0.0.1:{admin}")
            args = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n",
                    "--pidfile=", "--logfile", str(work / f"c{i}.log"), "llmgw", "control",
                    "--insecure", "--agent-listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}",
                    "--gateway", "off", "--catalog", str(catalog),
                    "--heartbeat", str(self.heartbeat), "--adoption-grace", str(self.grace),
                    "--max-connections-per-address", "0"]
            if self.ha:
                args += ["--etcd", ",".join(etcd_urls), "--etcd-ttl", str(self.ttl), "--member-id", f"c{i}"]
            m = Member(f"c{i}" if self.ha else "standalone", args, work / f"c{i}{'' if self.ha else '-standalone'}.log")
            m.start(self.reactor)
            self.members.append(m)

    async def status(self, i: int) -> dict[str, Any] | None:
        import treq

        try:
            r = await treq.get(self.admin[i] + "/api/v1/status", timeout=1.0, persistent=False)
            return await r.json()  # type: ignore[no-any-return]
        except Exception:  # noqa: BLE001 - dead, starting or busy
            return None

    async def replicas(self, i: int) -> list[dict[str, Any]]:
        import treq

        try:
            r = await treq.get(self.admin[i] + "/api/v1/replicas", timeout=5.0, persistent=False)
            return (await r.json())["replicas"]  # type: ignore[no-any-return]
        except Exception:  # noqa: BLE001
            return []

    async def leader(self) -> int | None:
        for i, m in enumerate(self.members):
            if m.alive:
                st = await self.status(i)
                if st is not None and (st.get("role") == "leader" or not self.ha):
                    return i
        return None

    async def sleep(self, seconds: float) -> None:
        await task.deferLater(self.reactor, seconds, lambda: None)

    async def until(self, what: str, check: Any, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = await check()
            if value is not None and value is not False:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout}s")
            await self.sleep(0.1)

    async def run(self, kills: int, etcd_urls: list[str] | None = None) -> dict[str, Any]:
        watch: Any = None
        etcd: Any = None
        watching = True
        if self.ha and etcd_urls:
            from llmgw.control.ha.election import DEFAULT_PREFIX, leader_key
            from llmgw.etcd import EtcdClient

            etcd = EtcdClient(self.reactor, etcd_urls)

            def rewatch(_: Any = None) -> None:
                nonlocal watch
                if watching:
                    watch = etcd.watch(leader_key(DEFAULT_PREFIX), self.leader_key_events)
                    watch.done.addBoth(lambda _: self.reactor.callLater(0.1, rewatch) if watching else None)

            rewatch()
        for node in self.nodes:
            node.target = random.randrange(len(self.controls))
            self.reactor.callLater(random.random() * 2, node.dial)
        hb = task.LoopingCall(self.heartbeats)
        hb.clock = self.reactor
        hb.start(self.heartbeat, now=False)

        async def all_ready() -> bool:
            i = await self.leader()
            if i is None:
                return False
            reps = await self.replicas(i)
            return len([r for r in reps if r["state"] == "ready"]) == self.n

        await self.until("every replica ready", all_ready, 180)
        per_kill: list[dict[str, Any]] = []
        for k in range(kills):
            i = await self.until("a leader", self.leader, 60)
            leader_address = self.controls[i]
            await self.until(
                "every agent on the leader",
                lambda addr=leader_address: defer.succeed(  # type: ignore[misc]
                    sum(n.registered_with == addr for n in self.nodes) == self.n or None
                ),
                60,
            )
            for node in self.nodes:
                node.stray = True
            self.phase = "failover"
            self.killed = self.controls[i]
            self.t_first_register = self.t_all = self.t_first_command = None
            self.t_all_strays = self.t_key_deleted = self.t_key_put = None
            self.strays_stopped = 0
            self.new_leader = None
            self.on_leader = {}
            self.t_kill = time.monotonic()
            os.kill(self.members[i].proc.pid, signal.SIGKILL)
            await self.members[i].out.ended
            if not self.ha:
                self.members[i].start(self.reactor)

            async def elected(old: int = i) -> int | None:
                j = await self.leader()
                return j if j is not None and (j != old or not self.ha) else None

            j = await self.until("a new leader", elected, self.ttl * 3 + 20)
            t_elected_seen = time.monotonic()
            st = await self.status(j)
            await self.until("all agents on the new leader",
                             lambda: defer.succeed(self.t_all is not None and self.t_all_strays is not None or None),
                             60)
            # Past the adoption grace, nothing may be placed again.
            await self.sleep(max(0.0, self.grace - (time.monotonic() - self.t_all)) + 2.0)
            reps = await self.replicas(j)
            owners: dict[str, list[str]] = {}
            for node in self.nodes:
                for rs in node.shards.values():
                    owners.setdefault(rs.replica_id, []).append(node.node_id)
            duplicates = sum(len(v) - 1 for v in owners.values()) + max(0, len(reps) - self.n)
            assert self.t_first_register is not None and self.t_all is not None
            assert self.t_first_command is not None and self.t_all_strays is not None

            def since_kill(t: float | None) -> float | None:
                return None if t is None else round(t - self.t_kill, 3)

            per_kill.append({
                "kill": k + 1,
                "old_leader": self.members[i].name,
                "new_leader": self.members[j].name,
                "epoch": (st or {}).get("epoch"),
                "to_first_register_s": round(self.t_first_register - self.t_kill, 3),
                "to_all_registered_s": round(self.t_all - self.t_kill, 3),
                "to_first_command_s": round(self.t_first_command - self.t_kill, 3),
                "to_all_strays_stopped_s": round(self.t_all_strays - self.t_kill, 3),
                "to_lease_expired_s": since_kill(self.t_key_deleted),
                "to_elected_s": since_kill(self.t_key_put),
                "elected_to_first_command_s": (
                    None if self.t_key_put is None else round(self.t_first_command - self.t_key_put, 3)),
                "all_registered_after_first_s": round(self.t_all - self.t_first_register, 3),
                "leader_seen_s": round(t_elected_seen - self.t_kill, 3),
                "replicas_listed": len(reps),
                "duplicates": duplicates,
            })
            print(json.dumps(per_kill[-1]), file=sys.stderr, flush=True)
            self.phase = "steady"
            if self.ha:
                self.members[i].start(self.reactor)
            await self.until("the killed member back", lambda m=i: self.status(m), 60)
        hb.stop()
        watching = False
        if watch is not None:
            watch.cancel()
            await etcd.close()
        return {"kills": per_kill}


def summarize(res: dict[str, Any], ttl: int, n: int) -> dict[str, Any]:
    kills = res["kills"]

    def col(name: str) -> dict[str, Any]:
        return summary_ms([int(k[name] * 1e9) for k in kills])

    def col_known(name: str) -> dict[str, Any]:
        return summary_ms([int(k[name] * 1e9) for k in kills if k.get(name) is not None])

    first_cmd = col("to_first_command_s")
    after = col("all_registered_after_first_s")
    return {
        "to_first_register": col("to_first_register_s"),
        "to_all_registered": col("to_all_registered_s"),
        "to_first_command": first_cmd,
        "to_all_strays_stopped": col("to_all_strays_stopped_s"),
        "to_lease_expired": col_known("to_lease_expired_s"),
        "to_elected": col_known("to_elected_s"),
        "elected_to_first_command": col_known("elected_to_first_command_s"),
        "all_registered_after_first_register": after,
        "bars": {
            "first_command_p99_within_ttl_plus_2s": first_cmd.get("p99_ms", 1e12) <= (ttl + 2) * 1000,
            "all_agents_within_10s_of_election_p99": after.get("p99_ms", 1e12) <= 10_000,
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--agents", type=int, default=1000)
    p.add_argument("--ttl", type=int, default=5, help="the leader lease TTL (--etcd-ttl)")
    p.add_argument("--grace", type=float, default=5.0, help="--adoption-grace of the members")
    p.add_argument("--baseline-kills", type=int, default=5,
                   help="kills of the baseline (one standalone control plane, restarted at once)")
    p.add_argument("--heartbeat", type=float, default=5.0)
    args = p.parse_args(argv)
    if ETCD_MISSING:
        print(json.dumps({"error": ETCD_MISSING}))
        return 2
    raise_nofile()
    from twisted.internet import reactor

    work = Path(tempfile.mkdtemp(prefix="llmgw-failover-"))
    cluster = EtcdCluster(1)
    out: dict[str, Any] = {}
    benches: list[Bench] = []

    async def one(ha: bool, kills: int) -> dict[str, Any]:
        bench = Bench(reactor, args.agents, args.ttl, args.grace, args.heartbeat, ha=ha)
        benches.append(bench)
        bench.start_members(work, cluster.urls)
        started = time.monotonic()
        try:
            res = await bench.run(kills, cluster.urls)
        finally:
            bench.running = False
            for m in bench.members:
                if m.alive:
                    os.kill(m.proc.pid, signal.SIGKILL)
                    await m.out.ended
            for node in bench.nodes:
                if node.stream is not None:
                    node.stream.transport.abortConnection()
        return {
            "seconds": round(time.monotonic() - started, 1),
            "shards_restarted": bench.restarts,
            "claimed_shards_stopped": bench.stops_of_claimed,
            "duplicates": sum(k["duplicates"] for k in res["kills"]),
            **summarize(res, args.ttl, args.agents),
            "per_kill": res["kills"],
        }

    async def go() -> None:
        try:
            await cluster.start(reactor)
            ha = await one(True, args.kills)
            out["ha"] = ha
            baseline = await one(False, args.baseline_kills)
            for key in ("bars",):
                baseline.pop(key, None)
            out.update({
                "benchmark": "failover",
                "agents": args.agents, "kills": args.kills, "lease_ttl_s": args.ttl,
                "adoption_grace_s": args.grace, "heartbeat_s": args.heartbeat,
                "transport": "plain TCP on loopback (--insecure)",
                "etcd_members": 1,
                "uptime_at_end": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                "ha": ha,
                "baseline_standalone_restarted_at_once": baseline,
                "bars": {
                    **ha["bars"],
                    "shards_restarted_0": ha["shards_restarted"] == 0 and ha["claimed_shards_stopped"] == 0,
                    "duplicates_0": ha["duplicates"] == 0,
                },
            })
        except Exception as e:  # noqa: BLE001 - reported in the JSON
            out["error"] = f"{e.__class__.__name__}: {e}"
            for bench in benches:
                for m in bench.members:
                    out.setdefault("member_logs", {})[m.name] = (
                        m.log_path.read_text()[-3000:] if m.log_path.exists() else "")
        finally:
            for bench in benches:
                bench.running = False
                for m in bench.members:
                    if m.alive:
                        os.kill(m.proc.pid, signal.SIGKILL)
                        await m.out.ended
            await cluster.stop()
            reactor.stop()

    reactor.callWhenRunning(lambda: defer.ensureDeferred(go()))
    reactor.run()
    print(json.dumps(out, indent=2))
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    sys.exit(main())
