"""
Models shared between nodes: bytes the source serves, and wall time, for
eight node caches that each need one model, fetched each from the source
and then through peers, in the same run.

    python bench/models.py [--size-mib 256] [--nodes 8] [--hub-mib 1024] [--out FILE]

Everything runs in this process on one reactor: an https source on
loopback (twisted.web over TLS with a server certificate of a CA made at
run time; it counts the bytes it writes), and per node a real
L{llmgw.models.cache.ModelCache} (its fetches in a shared thread pool, as
the agent's) with a real peer listener (L{llmgw.models.peerserve}, mutual
TLS with a node certificate of the same CA). Prints one JSON document.

How peers learn of each other: the control plane tells a node which peers
hold a complete copy when it tells it to fetch. Here the bench plays that
part in doubling waves: node 0 fetches from the source; each later wave
starts as many nodes as have finished, each told every finished node (its
list rotated so that each finished node is first for one of them). With
the default serving cap of 4 no peer refuses anyone.

The fetch's CPU (C{--hub-mib}, 0 to skip; needs C{olah-cli} beside this
Python and git): a file of that size in a git mirror served by a real
C{olah} on loopback, fetched by C{huggingface_hub}'s own C{hf_hub_download}
in a child process, and through a L{ModelCache} with the hub fetcher on a
reactor and a thread pool, as the agent fetches, in another; each child's
CPU seconds around the download (and for its whole life), and the second's
reactor's longest stall (how late a 5 ms timer ran), timed after
C{huggingface_hub} is imported, as in an agent after its first fetch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource as rusage
import shutil
import ssl
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from twisted.internet.defer import Deferred, gatherResults  # noqa: E402
from twisted.internet.task import LoopingCall  # noqa: E402
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory  # noqa: E402
from twisted.python.threadpool import ThreadPool  # noqa: E402
from twisted.web import resource, server, static  # noqa: E402

from llmgw.models.cache import ModelCache, thread_runner  # noqa: E402
from llmgw.models.https import HttpsFetcher  # noqa: E402
from llmgw.models.peerfetch import peering  # noqa: E402
from llmgw.models.peerserve import peer_listener  # noqa: E402
from llmgw.models.source import parse_source  # noqa: E402
from llmgw.tlsconf.ca import CertificateAuthority  # noqa: E402
from llmgw.tlsconf.options import ServerTLS, agent_files  # noqa: E402


class _Counting(ProtocolWrapper):
    def write(self, data: bytes) -> None:
        self.factory.sent += len(data)  # type: ignore[attr-defined]
        super().write(data)

    def writeSequence(self, data: Any) -> None:
        self.factory.sent += sum(len(d) for d in data)  # type: ignore[attr-defined]
        super().writeSequence(data)


class CountingFactory(WrappingFactory):
    """
    Counts the plaintext bytes its protocols write (headers and bodies).
    """

    protocol = _Counting
    sent = 0


class Stalls:
    """
    The reactor's longest stall: the most a 5 ms timer was late.
    """

    def __init__(self, reactor: Any) -> None:
        self.reactor = reactor
        self.worst = 0.0
        #: Seconds from L{start} to the end of the worst stall.
        self.when = 0.0
        self.last = self.began = reactor.seconds()
        self.loop = LoopingCall(self._tick)
        self.loop.clock = reactor

    def _tick(self) -> None:
        now = self.reactor.seconds()
        if now - self.last - 0.005 > self.worst:
            self.worst, self.when = now - self.last - 0.005, now - self.began
        self.last = now

    def start(self) -> None:
        self.worst, self.when = 0.0, 0.0
        self.last = self.began = self.reactor.seconds()
        self.loop.start(0.005, now=False)

    def stop(self) -> float:
        self.loop.stop()
        return self.worst


def cpu_seconds() -> float:
    r = rusage.getrusage(rusage.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def run(reactor: Any, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-models-"))
    try:
        return await _run(reactor, args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


async def _run(reactor: Any, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    if not args.nodes:
        hub = hub_cpu(args.hub_mib, work / "hub")
        return {"bench": "models", "fetch_cpu": hub}
    ca = CertificateAuthority.init(work / "ca")
    issued = ca.issue_server(["127.0.0.1"])
    nodes = [f"node-{i}" for i in range(args.nodes)]
    for node in nodes:
        ca.issue_agent(node)
    size = args.size_mib * 1024 * 1024
    model = work / "source" / "model.bin"
    model.parent.mkdir()
    digest = hashlib.sha256()
    with model.open("wb") as f:
        left = size
        while left:
            chunk = os.urandom(min(left, 1 << 20))
            f.write(chunk)
            digest.update(chunk)
            left -= len(chunk)

    root = resource.Resource()
    root.putChild(b"model.bin", static.File(str(model), defaultType="application/octet-stream"))
    counting = CountingFactory(server.Site(root))
    from twisted.internet import ssl as tssl
    source_tls = tssl.CertificateOptions(
        privateKey=tssl.PrivateCertificate.loadPEM(
            issued.cert_path.read_bytes() + issued.key_path.read_bytes()).privateKey.original,
        certificate=tssl.Certificate.loadPEM(issued.cert_path.read_bytes()).original)
    from twisted.internet.endpoints import SSL4ServerEndpoint
    port = await SSL4ServerEndpoint(reactor, 0, source_tls, interface="127.0.0.1").listen(counting)
    url = f"https://127.0.0.1:{port.getHost().port}/model.bin"
    source = parse_source(url, sha256=digest.hexdigest())
    ca_file = str(ca.cert_path)

    pool = ThreadPool(minthreads=0, maxthreads=args.nodes + 2, name="bench-models")
    pool.start()
    run_ = thread_runner(reactor, pool)
    stalls = Stalls(reactor)
    results: dict[str, Any] = {}
    try:
        for mode in ("from_source", "peers"):
            caches: list[ModelCache] = []
            listeners = []
            addresses = []
            for node in nodes:
                files = agent_files(ca.directory, node)
                cache = ModelCache(
                    work / mode / node, 2 * size,
                    {"https": HttpsFetcher(context=lambda: ssl.create_default_context(cafile=ca_file))},
                    reactor, run_, peering=peering(lambda files=files: files))  # type: ignore[misc]
                await cache.load()
                listener = peer_listener(reactor, "127.0.0.1", 0, cache.complete_files, ServerTLS(files))
                listener.startService()
                listeners.append(listener)
                addresses.append("{}:{}".format(*listener.address()))
                caches.append(cache)
            counting.sent = 0
            cpu0, t0 = cpu_seconds(), time.monotonic()
            stalls.start()
            done_at: list[float] = []
            waves: list[list[int]] = []
            if mode == "from_source":
                waves.append(list(range(len(nodes))))
                await gatherResults([c.ensure(source) for c in caches])
                done_at = [time.monotonic() - t0] * len(nodes)
            else:
                finished: list[int] = []
                waiting = list(range(len(nodes)))
                while waiting:
                    wave = waiting[: max(1, len(finished))]
                    waiting = waiting[len(wave):]
                    waves.append(wave)
                    ds = []
                    for j, i in enumerate(wave):
                        peers = [addresses[p] for p in finished]
                        if peers:
                            k = j % len(peers)
                            peers = peers[k:] + peers[:k]
                        ds.append(caches[i].ensure(source, peers=peers))
                    await gatherResults(ds)
                    done_at.extend([time.monotonic() - t0] * len(wave))
                    finished.extend(wave)
            wall = time.monotonic() - t0
            worst = stalls.stop()
            cpu = cpu_seconds() - cpu0
            results[mode] = {
                "source_bytes": counting.sent,
                "source_bytes_per_model": round(counting.sent / size, 3),
                "wall_s": round(wall, 2),
                "cpu_s": round(cpu, 2),
                "reactor_longest_stall_ms": round(worst * 1000, 1),
                "waves": " | ".join(",".join(map(str, w)) for w in waves),
            }
            for listener in listeners:
                await listener.stopService()
            for cache in caches:
                cache.stop()
            shutil.rmtree(work / mode, ignore_errors=True)
    finally:
        pool.stop()
        await port.stopListening()
    peers = results["peers"]
    hub = hub_cpu(args.hub_mib, work / "hub") if args.hub_mib else {"skipped": "--hub-mib 0"}
    bars: dict[str, Any] = {"source_bytes_at_most_1.25x_model": peers["source_bytes"] <= 1.25 * size}
    if "cpu_ratio" in hub:
        bars["fetch_cpu_at_most_1.2x_hf_hub_download"] = hub["cpu_ratio"] <= 1.2
        bars["fetch_reactor_stall_under_20ms"] = hub["cache"]["reactor_longest_stall_ms"] < 20
    return {
        "bench": "models",
        "config": {"nodes": args.nodes, "model_bytes": size, "cpus": os.cpu_count(),
                   "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                   "peer_rule": "doubling waves: node 0 from the source; each wave as many nodes as "
                                "have finished, each given every finished node (rotated)"},
        "fleet_sharing": results,
        "fetch_cpu": hub,
        "bars": bars,
    }


HF_CHILD = """
import json, resource, sys, time
from huggingface_hub import hf_hub_download
endpoint, directory = sys.argv[1:3]
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0, t0 = cpu(), time.monotonic()
hf_hub_download("bench/big", "model.bin", local_dir=directory, endpoint=endpoint, token=False)
print(json.dumps({"cpu_s": cpu() - c0, "wall_s": time.monotonic() - t0}))
"""


def agent_fetch(endpoint: str, directory: str) -> None:
    """
    The child that fetches through the cache, as the agent does: prints
    its CPU seconds, wall time and the reactor's longest stall.
    """
    # Imported before the clock starts, as in an agent after its first
    # fetch: the first import, in a fetch's thread, holds the interpreter.
    from huggingface_hub import HfApi, hf_hub_download  # noqa: F401
    from twisted.internet import reactor
    from twisted.internet.task import react

    from llmgw.models.hub import HubFetcher

    def body(reactor_: Any) -> Deferred[None]:
        async def go() -> None:
            pool = ThreadPool(minthreads=0, maxthreads=4, name="bench-agent")
            pool.start()
            cache = ModelCache(directory, 4 << 30, {"hf": HubFetcher(endpoint=endpoint, token=False)},
                               reactor_, thread_runner(reactor_, pool))
            await cache.load()
            stalls = Stalls(reactor_)
            c0, t0 = cpu_seconds(), time.monotonic()
            stalls.start()
            await cache.ensure(parse_source("hf://bench/big", file="model.bin"))
            worst = stalls.stop()
            print(json.dumps({"cpu_s": cpu_seconds() - c0, "wall_s": time.monotonic() - t0,
                              "reactor_longest_stall_ms": worst * 1000, "stall_at_s": stalls.when}))
            pool.stop()
        return Deferred.fromCoroutine(go())
    del reactor
    react(body)


def hub_cpu(mib: int, work: Path) -> dict[str, Any]:
    """
    The fetch CPU bar: C{hf_hub_download} against the cache's hub fetch of
    one C{mib} MiB file from olah on loopback, each in a child process.
    """
    import subprocess

    from llmgw.testing.ports import free_port, wait_bound

    olah = Path(sys.executable).with_name("olah-cli")
    if not olah.exists() or shutil.which("git") is None:
        return {"skipped": "olah-cli or git is missing"}
    repo = work / "mirrors" / "models" / "bench" / "big"
    repo.mkdir(parents=True)

    def git(*a: str) -> None:
        subprocess.run(["git", "-C", str(repo), "-c", "user.name=b", "-c", "user.email=b@b", *a],
                       check=True, capture_output=True)
    git("init", "-q", "-b", "main")
    blob = work / "blob"
    digest = hashlib.sha256()
    with blob.open("wb") as f:
        for _ in range(mib):
            chunk = os.urandom(1 << 20)
            f.write(chunk)
            digest.update(chunk)
    oid = digest.hexdigest()
    objects = repo / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4]
    objects.mkdir(parents=True)
    blob.rename(objects / oid)
    (repo / "model.bin").write_text(
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {mib << 20}\n")
    git("add", "-A")
    git("commit", "-qm", "big")
    port = free_port()
    config = work / "olah.toml"
    config.write_text(f'[basic]\nhost = "127.0.0.1"\nport = {port}\nrepos-path = "{work / "repos"}"\n'
                      f'mirrors-path = ["{work / "mirrors"}"]\n[accessibility]\noffline = true\n')
    log = (work / "olah.out").open("wb")
    proc = subprocess.Popen([str(olah), "-c", str(config), "--log-path", str(work / "logs")],
                            stdout=log, stderr=subprocess.STDOUT, cwd=work)
    try:
        if not wait_bound(proc, [port], lambda: (work / "olah.out").read_text(errors="replace"), 60):
            return {"skipped": "olah did not listen"}
        endpoint = f"http://127.0.0.1:{port}"
        out: dict[str, Any] = {"file_bytes": mib << 20}
        env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HOME": str(work / "hf-home")}
        for name, argv in (
            ("hf_hub_download", [sys.executable, "-c", HF_CHILD, endpoint, str(work / "hf")]),
            ("cache", [sys.executable, __file__, "--agent-fetch", endpoint, str(work / "cache")]),
        ):
            before = rusage.getrusage(rusage.RUSAGE_CHILDREN)
            done = subprocess.run(argv, check=True, capture_output=True, env=env)
            after = rusage.getrusage(rusage.RUSAGE_CHILDREN)
            figures = json.loads(done.stdout.decode().strip().splitlines()[-1])
            figures["process_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
            out[name] = {k: round(v, 3) for k, v in figures.items()}
        out["cpu_ratio"] = round(out["cache"]["cpu_s"] / out["hf_hub_download"]["cpu_s"], 2)
        out["process_cpu_ratio"] = round(
            out["cache"]["process_cpu_s"] / out["hf_hub_download"]["process_cpu_s"], 2)
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256, help="the model's size (MiB)")
    parser.add_argument("--nodes", type=int, default=8, help="0: only the fetch CPU bar")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--hub-mib", type=int, default=1024, help="the fetch CPU bar's file (MiB; 0: skip)")
    parser.add_argument("--agent-fetch", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent_fetch:
        agent_fetch(*args.agent_fetch)
        return
    from twisted.internet import reactor
    from twisted.internet.task import react

    def body(reactor_: Any) -> Deferred[None]:
        async def go() -> None:
            result = await run(reactor_, args)
            text = json.dumps(result, indent=2)
            print(text)
            if args.out:
                Path(args.out).write_text(text + "\n")
        return Deferred.fromCoroutine(go())
    del reactor
    react(body)


if __name__ == "__main__":
    main()
