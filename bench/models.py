"""
Models shared between nodes: bytes the source serves, and wall time, for
eight node caches that each need one model, fetched each from the source
and then through peers, in the same run.

    python bench/models.py [--size-mib 256] [--nodes 8] [--out FILE]

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
        self.last = reactor.seconds()
        self.loop = LoopingCall(self._tick)
        self.loop.clock = reactor

    def _tick(self) -> None:
        now = self.reactor.seconds()
        self.worst = max(self.worst, now - self.last - 0.005)
        self.last = now

    def start(self) -> None:
        self.worst, self.last = 0.0, self.reactor.seconds()
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
    return {
        "bench": "models",
        "config": {"nodes": args.nodes, "model_bytes": size, "cpus": os.cpu_count(),
                   "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                   "peer_rule": "doubling waves: node 0 from the source; each wave as many nodes as "
                                "have finished, each given every finished node (rotated)"},
        "fleet_sharing": results,
        "bars": {
            "source_bytes_at_most_1.25x_model": peers["source_bytes"] <= 1.25 * size,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256, help="the model's size (MiB)")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
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
