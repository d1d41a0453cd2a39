"""
Benchmark of nodes that join and renew (DESIGN §20), in one run; prints one
JSON document.

    python bench/join.py                  # 1,000 joins, 10,000 renewals: a few minutes
    python bench/join.py --quick          # 100 joins, 1,000 renewals
    python bench/join.py --skip-renewal   # the join storm only

Joining: N agents with pre-issued certificates register with a control
plane (the baseline), then N agents that have only a join token join and
register with a second control plane started the same way (C{--signer},
C{--join-listen}); both from a common start with the same dial spread. The
bar: the joining fleet is all joined and registered within 2x the time the
pre-issued one took to register.

A third fleet each round (the floor; C{--no-floor} leaves it out): the
pre-issued agents again, each opening the join's connection (handshake, the
chain checked) and closing it unused before it registers. No join on a
connection of its own can take less than this fleet's time.

Renewal: L{bench.join_renewal}, in a process of its own. The bar: no
reconcile pass and no reactor turn over 20 ms because of renewals.

See bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.agent_stream import Background, Child, ChildError, make_certs, rate_peak  # noqa: E402
from bench.common import proc_cpu_seconds, raise_nofile, summary_ms  # noqa: E402
from llmgw.control.core.jointokens import TokenFile  # noqa: E402
from llmgw.tlsconf.ca import CertificateAuthority  # noqa: E402
from llmgw.tlsconf.csr import spki_hash  # noqa: E402
from llmgw.tlsconf.jointoken import printable  # noqa: E402

PRE = "pre-"
JOIN = "join-"
#: How the two control planes run, beside bench.target's own options: a
#: signer, so joins are signed at once, and the join listener.
CONTROL_ARGS = ["--signer", "--join-listen=127.0.0.1:0", "--cert-lifetime=1d"]
#: The bar: joining and registering within this many times the pre-issued fleet's time.
BAR_RATIO = 2.0
#: What each fleet's time counts, from the common start (T0) to the control
#: plane's last registration; the rest is done when the agents' processes start.
CLOCK = {
    "preissued": {
        "in": "dial, TLS handshake with the node certificate, Register, the control plane's registration",
        "out": "the node certificates and keys (issued by the orchestrator), each agent's TLS context "
               "and Register message (made when its process starts)",
    },
    "joining": {
        "in": "the key (P-256, written 0600) and CSR, the join connection (TLS handshake, chain checked "
              "against the token's CA hash before anything is sent), the control plane's checks, "
              "signature, issued.jsonl and token-book write (one fsynced group commit, which the answer "
              "waits for), the certificate and CA bundle checked and written, the certificate, key and "
              "CA roots loaded into the agent's TLS context, then dial, handshake, Register, registration",
        "out": "each agent's Joiner with its two TLS contexts, the join's and the agent stream's without "
               "an identity yet (made when its process starts, as `twistd llmgw agent --join` makes "
               "them when it parses its options) and its Register message but for the certificate's "
               "end (set after the join), as the pre-issued agents' is",
    },
    "floor": {
        "in": "the join's connection to the join listener (TLS handshake, the chain checked against the "
              "token's CA hash) closed without a request, then what the pre-issued fleet's clock holds",
        "out": "as the pre-issued fleet's, and the joiner's TLS context (one for the fleet)",
    },
}


def make_token(certs: Path, uses: int) -> str:
    """A token of C{uses} uses for C{JOIN}-prefixed nodes, kept in the control plane's file."""
    tokens = TokenFile(certs / "join-tokens.json")
    tokens.load()
    token, secret = tokens.book.create(time.time(), 3600, uses, JOIN)
    tokens.save()
    ca = CertificateAuthority.load(certs)
    return printable(token.id, secret, spki_hash(ca.certificate))


def files_probe(base: Path, nodes: int = 200) -> dict[str, Any]:
    """
    This process's CPU (user and system) for what a join writes, per node,
    in a new directory under C{base}: a state directory, then three files
    (the key, the certificate, the bundle), each through a temporary file
    and a rename. On this 2-CPU machine's ext4 it has varied from 0.1 to
    2.8 ms from one minute to the next (tmpfs: about 0.05 ms), which the
    joining nodes' CPU carries.
    """
    import secrets

    root = Path(tempfile.mkdtemp(prefix="llmgw-bench-files-", dir=base))
    try:
        r0 = os.times()
        for i in range(nodes):
            d = root / f"n{i}"
            d.mkdir()
            for name in ("agent.key", "agent.pem", "ca.pem"):
                tmp = d / f".{name}.{secrets.token_hex(4)}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                os.write(fd, b"x" * 700)
                os.close(fd)
                os.replace(tmp, d / name)
        r1 = os.times()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"base": str(base), "nodes": nodes,
            "user_ms_per_node": round((r1.user - r0.user) * 1000 / nodes, 3),
            "system_ms_per_node": round((r1.system - r0.system) * 1000 / nodes, 3)}


def run_fleet(kind: str, args: argparse.Namespace, certs: Path, workdir: Path,
              sims: list[Child]) -> dict[str, Any]:
    """One control plane, one storm of C{sims}' agents, until all registered."""
    n = args.agents
    argv = ["-m", "bench.target", "--kind", "control", "--certs", str(certs),
            "--log", str(workdir / f"control-{kind}.log"),
            "--heartbeat-interval", str(args.heartbeat_interval)]
    argv += [f"--control-arg={a}" for a in CONTROL_ARGS]
    server = Child(f"control-{kind}", argv, workdir)
    out: dict[str, Any] = {}
    try:
        hello = server.recv(30)
        time.sleep(0.5)
        pids = [server.pid] + [s.pid for s in sims]
        bg = Background(pids)
        cpu0 = proc_cpu_seconds(server.pid)
        sim_cpu0 = sum(proc_cpu_seconds(s.pid) for s in sims)
        if args.profile:
            server.call("profile", 10, action="start", clock="cpu")
            sims[0].call("profile", 10, action="start", clock="cpu")
        t0 = time.monotonic_ns() + 300_000_000
        for sim in sims:
            sim.send("storm", host="127.0.0.1", port=hello["port"], join_port=hello["join_port"],
                     kind="control", t0_ns=t0, jitter_s=args.jitter, timeout=args.timeout, cpu=[])
        reg = server.call("await", args.timeout + 5, count=n, timeout=args.timeout)
        cpu1 = proc_cpu_seconds(server.pid)
        sim_cpu1 = sum(proc_cpu_seconds(s.pid) for s in sims)
        dial: list[int] = []
        up: list[int] = []
        joined: list[int] = []
        asks: list[int] = []
        summed: dict[str, Any] = {"reconnects": 0, "lost_reasons": {}, "refusals": {}, "join_errors": {}}
        for sim in sims:
            r = sim.recv(args.timeout + 10)
            if args.profile and sim is sims[0]:
                out_profile = {"agents_top": sim.call(
                    "profile", 60, action="stop", path=str(workdir / f"{kind}-sim.prof"))["top"]}
            dial += r["dial_ns"]
            up += r["up_ns"]
            joined += r.get("joined_ns", [])
            asks += r.get("join_asks", [])
            summed["reconnects"] += r["reconnects"]
            for k in ("lost_reasons", "refusals", "join_errors"):
                for why, c in r.get(k, {}).items():
                    summed[k][why] = summed[k].get(why, 0) + c
        wall = (reg["t_ns"] - t0) / 1e9 if reg["t_ns"] else float("nan")
        out = {
            "agents": n,
            "registered": reg["registered"],
            "timed_out": bool(reg.get("timed_out")),
            "all_registered_s": round(wall, 3),
            "dial_spread_s": args.jitter,
            "dial_to_up": summary_ms([u - d for d, u in zip(dial, up, strict=True) if u and d]),
            "peak_registrations_per_s_1s": rate_peak([u for u in up if u]),
            "server_cpu_s": round(cpu1 - cpu0, 2),
            "server_cpu_ms_per_agent": round((cpu1 - cpu0) * 1000 / n, 2),
            "agents_cpu_s": round(sim_cpu1 - sim_cpu0, 2),
            "agents_cpu_ms_per_agent": round((sim_cpu1 - sim_cpu0) * 1000 / n, 2),
            # Both sides share the machine's cores: the storm's time follows this.
            "total_cpu_ms_per_agent": round((cpu1 - cpu0 + sim_cpu1 - sim_cpu0) * 1000 / n, 2),
            "other_processes_cpu_cores": bg.cores(),
            **summed,
        }
        if joined:
            done = [j for j in joined if j]
            out["joined"] = len(done)
            out["all_joined_s"] = round((max(done) - t0) / 1e9, 3) if done else None
            out["dial_to_joined"] = summary_ms([j - d for d, j in zip(dial, joined, strict=True) if j and d])
            out["joined_to_up"] = summary_ms([u - j for j, u in zip(joined, up, strict=True) if u and j])
            out["join_requests"] = sum(asks)
            out["agents_asking_more_than_once"] = sum(1 for a in asks if a > 1)
        if args.profile:
            out_profile["server_top"] = server.call(
                "profile", 60, action="stop", path=str(workdir / f"{kind}-server.prof"))["top"]
            out["profile"] = out_profile
        stats = server.call("stats", 30)
        out["server"] = {"connected": stats["connected"], "admission": stats["admission"],
                         "registrations": stats["registrations"]}
        for sim in sims:
            sim.call("disconnect", 60)
    finally:
        server.stop()
    return out


def start_sims(module: str, n: int, count: int, extra: list[str], workdir: Path,
               args: argparse.Namespace) -> list[Child]:
    per = -(-n // count)
    children = []
    for i in range(count):
        first = i * per
        size = min(per, n - first)
        if size <= 0:
            break
        children.append(Child(f"{module.rsplit('.', 1)[-1]}{i}", [
            "-m", module, "--first", str(first), "--count", str(size),
            "--heartbeat-interval", str(args.heartbeat_interval), *extra], workdir))
    for c in children:
        c.recv(600)
    return children


def join_bars(pre: dict[str, Any], joining: dict[str, Any]) -> dict[str, Any]:
    limit = BAR_RATIO * pre["all_registered_s"]
    got = joining["all_registered_s"]
    ok = (joining["registered"] == joining["agents"] and pre["registered"] == pre["agents"]
          and joining.get("joined") == joining["agents"] and got <= limit)
    return {"want": f"<= {BAR_RATIO} x pre-issued ({round(limit, 3)} s)", "got": got,
            "ratio": round(got / pre["all_registered_s"], 3) if pre["all_registered_s"] else None,
            "cpu_ratio": round(joining["total_cpu_ms_per_agent"] / pre["total_cpu_ms_per_agent"], 2)
            if pre["total_cpu_ms_per_agent"] else None,
            # What bounds a storm where the nodes are other machines.
            "server_cpu_ratio": round(joining["server_cpu_ms_per_agent"] / pre["server_cpu_ms_per_agent"], 2)
            if pre["server_cpu_ms_per_agent"] else None,
            "ok": ok}


def run_renewal(args: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.join_renewal", "--agents", str(args.renewals),
            "--lifetime", str(args.lifetime)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, timeout=args.lifetime * 3 + 600)
    if done.returncode != 0:
        raise ChildError(f"bench.join_renewal exited {done.returncode}: {done.stderr.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Join and renewal benchmark; prints one JSON document.")
    p.add_argument("--agents", type=int, default=None, help="agents in each storm (default 1000)")
    p.add_argument("--renewals", type=int, default=None, help="agents that renew (default 10000)")
    p.add_argument("--lifetime", type=float, default=None,
                   help="the compressed certificate lifetime the renewals spread over, s (default 60)")
    p.add_argument("--quick", action="store_true", help="100 joins, 1,000 renewals over 20 s")
    p.add_argument("--jitter", type=float, default=1.0,
                   help="storm dial spread, s: 'at once' within this (default 1)")
    p.add_argument("--heartbeat-interval", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3,
                   help="pre-issued then joining storms, each pair in turn (the machine's load changes)")
    p.add_argument("--sims", type=int, default=2, help="simulated-agent processes per fleet")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--skip-renewal", action="store_true")
    p.add_argument("--skip-join", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="cProfile the control plane and one agent process over each storm")
    p.add_argument("--keep", action="store_true", help="keep the work directory (certs, logs)")
    p.add_argument("--no-floor", dest="floor", action="store_false",
                   help="leave out the floor fleet (pre-issued agents that open and close a join "
                        "connection before they register: what no join on its own connection beats)")
    p.add_argument("--nodes-base", type=Path, default=None,
                   help="where the joining agents' state directories go (default: the work directory); "
                        "/dev/shm leaves out this machine's disk, which all 1,000 simulated nodes share")
    args = p.parse_args(argv)
    defaults = ({"agents": 100, "renewals": 1000, "lifetime": 20.0} if args.quick
                else {"agents": 1000, "renewals": 10000, "lifetime": 60.0})
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    t_start = time.monotonic()
    nofile = raise_nofile()
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-join-"))
    certs = workdir / "certs"
    children: list[Child] = []
    import OpenSSL

    import twisted
    result: dict[str, Any] = {"config": {
        "agents": args.agents, "renewals": args.renewals, "quick": args.quick, "rounds": args.rounds,
        "dial_jitter_s": args.jitter, "heartbeat_interval_s": args.heartbeat_interval,
        "sim_processes_per_fleet": args.sims, "control_args": CONTROL_ARGS,
        "cpus": sorted(os.sched_getaffinity(0)), "rlimit_nofile": nofile, "reactor": "epoll",
        "python": platform.python_version(), "twisted": twisted.__version__,
        "openssl": OpenSSL.SSL.SSLeay_version(OpenSSL.SSL.SSLEAY_VERSION).decode(),
        "clock": CLOCK, "floor": args.floor,
        "nodes_state_dirs": str(args.nodes_base or "the work directory"),
    }}
    bars: dict[str, Any] = {}
    try:
        if not args.skip_join:
            result["setup"] = make_certs(certs, args.agents, max(1, len(os.sched_getaffinity(0))), PRE)
            token = make_token(certs, args.agents * args.rounds)
            pre = start_sims("bench.simagents", args.agents, args.sims,
                             ["--certs", str(certs), "--prefix", PRE], workdir, args)
            children += pre
            rounds = []
            for r in range(args.rounds):
                # Each round: the pre-issued fleet, then a fleet of new nodes
                # joining, each against a control plane of its own.
                one: dict[str, Any] = {"preissued": run_fleet(f"preissued-{r}", args, certs, workdir, pre)}
                nodes = (Path(tempfile.mkdtemp(prefix="llmgw-bench-nodes-", dir=args.nodes_base))
                         if args.nodes_base else workdir) / f"nodes-{r}"
                one["node_files_before"] = files_probe(args.nodes_base or workdir)
                joining = start_sims("bench.joinagents", args.agents, args.sims,
                                     ["--nodes-dir", str(nodes), "--token", token,
                                      "--prefix", f"{JOIN}{r}-"], workdir, args)
                children += joining
                one["joining"] = run_fleet(f"joining-{r}", args, certs, workdir, joining)
                for c in joining:
                    c.stop()
                modes = {oct(p.stat().st_mode & 0o777) for p in nodes.glob("*/agent-*.key")}
                one["joining"]["node_key_file_modes"] = sorted(modes)
                if args.nodes_base:
                    shutil.rmtree(nodes.parent, ignore_errors=True)
                one["bar"] = join_bars(one["preissued"], one["joining"])
                if args.floor:
                    floor = start_sims("bench.joinagents", args.agents, args.sims,
                                       ["--floor", "--certs", str(certs), "--token", token,
                                        "--prefix", PRE], workdir, args)
                    children += floor
                    one["floor"] = run_fleet(f"floor-{r}", args, certs, workdir, floor)
                    for c in floor:
                        c.stop()
                    floor_bar = join_bars(one["preissued"], one["floor"])
                    one["bar"]["floor_ratio"] = floor_bar["ratio"]
                    one["bar"]["floor_cpu_ratio"] = floor_bar["cpu_ratio"]
                rounds.append(one)
            result["rounds"] = rounds
            median = statistics.median(r["bar"]["ratio"] or float("inf") for r in rounds)
            bars["join_storm"] = {
                "want": f"joined and registered within {BAR_RATIO}x the pre-issued fleet's time",
                "ratios": [r["bar"]["ratio"] for r in rounds],
                "median_ratio": round(median, 3),
                "rounds_ok": sum(1 for r in rounds if r["bar"]["ok"]),
                "floor_ratios": [r["bar"].get("floor_ratio") for r in rounds],
                "rounds": len(rounds),
                "ok": all(r["joining"]["registered"] == args.agents for r in rounds) and median <= BAR_RATIO,
            }
        if not args.skip_renewal:
            result["renewal"] = run_renewal(args)
            bars["renewal"] = result["renewal"]["bar"]
        result["bars"] = bars
        result["total_s"] = round(time.monotonic() - t_start, 1)
    except ChildError as e:
        result["error"] = str(e)
        print(json.dumps(result, indent=2))
        return 1
    finally:
        for c in children:
            c.stop()
        if args.keep:
            print(f"work directory kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
