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
from collections.abc import Iterator
from contextlib import contextmanager
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
        #: The longest stalls seen, (ms late, seconds from L{start}), worst first.
        self.top: list[tuple[float, float]] = []
        self.worst = 0.0
        #: Seconds from L{start} to the end of the worst stall.
        self.when = 0.0
        self.last = self.began = reactor.seconds()
        self.loop = LoopingCall(self._tick)
        self.loop.clock = reactor

    def _tick(self) -> None:
        now = self.reactor.seconds()
        late = now - self.last - 0.005
        if late > self.worst:
            self.worst, self.when = late, now - self.began
        if late > 0.005 and (len(self.top) < 5 or late * 1000 > self.top[-1][0]):
            self.top = sorted([*self.top, (round(late * 1000, 1), round(now - self.began, 2))],
                              reverse=True)[:5]
        self.last = now

    def start(self) -> None:
        self.worst, self.when, self.top = 0.0, 0.0, []
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
        out: dict[str, Any] = {"bench": "models", "bars": {}}
        if args.hub_mib:
            out["fetch_cpu"] = hub = hub_cpu(args.hub_mib, work / "hub", args.before)
            out["bars"].update(_hub_bars(hub))
        if args.pad_mib:
            out["first_token"] = first = first_token(args.pad_mib, work / "first-token")
            out["bars"].update(first.get("bars", {}))
        return out
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
    hub = hub_cpu(args.hub_mib, work / "hub", args.before) if args.hub_mib else {"skipped": "--hub-mib 0"}
    bars: dict[str, Any] = {"source_bytes_at_most_1.25x_model": peers["source_bytes"] <= 1.25 * size}
    bars.update(_hub_bars(hub))
    first = first_token(args.pad_mib, work / "first-token") if args.pad_mib else {"skipped": "--pad-mib 0"}
    bars.update(first.get("bars", {}))
    return {
        "bench": "models",
        "config": {"nodes": args.nodes, "model_bytes": size, "cpus": os.cpu_count(),
                   "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                   "peer_rule": "doubling waves: node 0 from the source; each wave as many nodes as "
                                "have finished, each given every finished node (rotated)"},
        "fleet_sharing": results,
        "fetch_cpu": hub,
        "first_token": first,
        "bars": bars,
    }


def _hub_bars(hub: dict[str, Any]) -> dict[str, bool]:
    if "cpu_ratio" not in hub:
        return {}
    return {"fetch_cpu_at_most_1.2x_hf_hub_download": hub["cpu_ratio"] <= 1.2,
            "fetch_reactor_stall_under_20ms": hub["cache"]["reactor_longest_stall_ms"] < 20}


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


def agent_fetch(endpoint: str, directory: str, repo: str = "bench/big", file: str = "model.bin") -> None:
    """
    The child that fetches through the cache, as the agent does: prints
    its CPU seconds, wall time and the reactor's longest stall.
    """
    # Imported before the clock starts, as in an agent after its first
    # fetch: the first import, in a fetch's thread, holds the interpreter.
    from huggingface_hub import HfApi, hf_hub_download  # noqa: F401
    from twisted.internet import reactor
    from twisted.internet.task import deferLater, react

    from llmgw.models.hub import HubFetcher

    def body(reactor_: Any) -> Deferred[None]:
        async def go() -> None:
            pool = ThreadPool(minthreads=0, maxthreads=4, name="bench-agent")
            pool.start()
            cache = ModelCache(directory, 4 << 30, {"hf": HubFetcher(endpoint=endpoint, token=False)},
                               reactor_, thread_runner(reactor_, pool))
            await cache.load()
            stalls = Stalls(reactor_)
            # The same heartbeat with nothing else to do, first: how late
            # the machine's own load makes a timer, beside the fetch's.
            stalls.start()
            await deferLater(reactor_, 3.0)
            idle = stalls.stop()
            c0, t0 = cpu_seconds(), time.monotonic()
            stalls.start()
            await cache.ensure(parse_source(f"hf://{repo}", file=file))
            worst = stalls.stop()
            print(json.dumps({"cpu_s": cpu_seconds() - c0, "wall_s": time.monotonic() - t0,
                              "reactor_longest_stall_ms": worst * 1000, "stall_at_s": stalls.when,
                              "reactor_idle_3s_longest_stall_ms": idle * 1000,
                              "stalls_over_5ms": [list(t) for t in stalls.top]}))
            pool.stop()
        return Deferred.fromCoroutine(go())
    del reactor
    react(body)


def _olah_missing() -> bool:
    return not Path(sys.executable).with_name("olah-cli").exists() or shutil.which("git") is None


def lfs_mirror(mirrors: Path, name: str, files: dict[str, Path]) -> None:
    """
    A git repository C{name} under C{mirrors} (olah's C{mirrors-path}), its
    C{files} (moved there) stored as git-lfs stores them.
    """
    import subprocess

    repo = mirrors / "models" / name
    repo.mkdir(parents=True)

    def git(*a: str) -> None:
        subprocess.run(["git", "-C", str(repo), "-c", "user.name=b", "-c", "user.email=b@b", *a],
                       check=True, capture_output=True)
    git("init", "-q", "-b", "main")
    for path, blob in files.items():
        digest = hashlib.sha256()
        with blob.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        oid = digest.hexdigest()
        objects = repo / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4]
        objects.mkdir(parents=True)
        size = blob.stat().st_size
        blob.rename(objects / oid)
        (repo / path).write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n")
    git("add", "-A")
    git("commit", "-qm", "model")


@contextmanager
def olah_running(work: Path) -> Iterator[str | None]:
    """
    A real olah on loopback, offline, serving C{work/mirrors}, for the
    block: its endpoint (for C{HF_ENDPOINT}), or C{None} if it did not listen.
    """
    import subprocess

    from llmgw.testing.ports import free_port, wait_bound

    port = free_port()
    config = work / "olah.toml"
    config.write_text(f'[basic]\nhost = "127.0.0.1"\nport = {port}\nrepos-path = "{work / "repos"}"\n'
                      f'mirrors-path = ["{work / "mirrors"}"]\n[accessibility]\noffline = true\n')
    olah = Path(sys.executable).with_name("olah-cli")
    with (work / "olah.out").open("wb") as log:
        proc = subprocess.Popen([str(olah), "-c", str(config), "--log-path", str(work / "logs")],
                                stdout=log, stderr=subprocess.STDOUT, cwd=work)
        try:
            bound = wait_bound(proc, [port], lambda: (work / "olah.out").read_text(errors="replace"), 60)
            yield f"http://127.0.0.1:{port}" if bound else None
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def hub_cpu(mib: int, work: Path, before: str | None = None) -> dict[str, Any]:
    """
    The fetch CPU bar: C{hf_hub_download} against the cache's hub fetch of
    one C{mib} MiB file from olah on loopback, each in a child process; and
    the fetch of the llmgw tree at C{before} too, when given.
    """
    import subprocess


    if _olah_missing():
        return {"skipped": "olah-cli or git is missing"}
    work.mkdir(parents=True, exist_ok=True)
    blob = work / "blob"
    with blob.open("wb") as f:
        for _ in range(mib):
            f.write(os.urandom(1 << 20))
    lfs_mirror(work / "mirrors", "bench/big", {"model.bin": blob})
    with olah_running(work) as endpoint:
        if endpoint is None:
            return {"skipped": "olah did not listen"}
        out: dict[str, Any] = {"file_bytes": mib << 20}
        env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HOME": str(work / "hf-home")}
        legs = [("hf_hub_download", [sys.executable, "-c", HF_CHILD, endpoint, str(work / "hf")])]
        if before is not None:
            legs.append(("cache_before", [sys.executable, str(Path(before) / "bench" / "models.py"),
                                          "--agent-fetch", endpoint, str(work / "cache-before")]))
        legs.append(("cache", [sys.executable, __file__, "--agent-fetch", endpoint, str(work / "cache")]))
        for name, argv in legs:
            r0 = rusage.getrusage(rusage.RUSAGE_CHILDREN)
            done = subprocess.run(argv, check=True, capture_output=True, env=env)
            r1 = rusage.getrusage(rusage.RUSAGE_CHILDREN)
            figures = json.loads(done.stdout.decode().strip().splitlines()[-1])
            figures["process_cpu_s"] = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
            out[name] = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}
        out["cpu_ratio"] = round(out["cache"]["cpu_s"] / out["hf_hub_download"]["cpu_s"], 2)
        out["process_cpu_ratio"] = round(
            out["cache"]["process_cpu_s"] / out["hf_hub_download"]["process_cpu_s"], 2)
        if before is not None:
            out["cpu_ratio_before"] = round(out["cache_before"]["cpu_s"] / out["hf_hub_download"]["cpu_s"], 2)
        return out

FIRST_TOKEN_CATALOG = """
[profiles.llama-cpu]
engine = "llamacpp"
gpus_per_shard = 1
program = {binary}

[[deployments]]
model = "tiny"
profile = "llama-cpu"
replicas = 1
source = "hf://bench/tiny"
file = "model.gguf"
args = {args}
"""

#: llama-server's flags in every leg: the engine's own start and the fleet's.
ENGINE_ARGS = ["-c", "512", "-np", "2", "-t", "1", "--no-warmup", "-ngl", "0"]


class _Cleanups:
    """
    Stands in for a test case where L{llmgw.testing.ports.port_block} wants one.
    """

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def addCleanup(self, f: Any, *a: Any) -> None:  # noqa: N802
        self.calls.append((f, a))

    def run(self) -> None:
        for f, a in reversed(self.calls):
            f(*a)


def _poll(what: str, check: Any, timeout: float, interval: float = 0.02) -> float:
    """
    Call C{check} until it is true: the C{time.monotonic()} it first was.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return time.monotonic()
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(interval)


def _kill_mentioning(text: str) -> None:
    """
    SIGKILL every process whose command line mentions C{text} (engines a
    fleet started in their own sessions name their model under it).
    """
    import signal

    needle = text.encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            pass


def _body(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=2) as response:
        return bytes(response.read())


def _get(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def _first_token(gateway: str, timeout: float) -> float:
    """
    Stream chats through the gateway until one sends a token: when it did.
    """
    import http.client

    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
                       "max_tokens": 4, "stream": True, "ignore_eos": True}).encode()
    host, port = gateway.rsplit(":", 1)

    def attempt() -> bool:
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        try:
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                response.read()
                return False
            for line in response:
                if line.startswith(b"data: {"):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if (choices[0].get("delta") or {}).get("content"):
                        return True
            return False
        finally:
            conn.close()
    return _poll("a first token through the gateway", attempt, timeout, 0.05)


def first_token(pad_mib: int, work: Path) -> dict[str, Any]:
    """
    The start-to-first-token bars: the tiny GGUF padded to C{pad_mib} MiB
    in a mirror served by a real olah; the cache's fetch of it alone, the
    engine's own readiness on the cached file, and a local fleet's start to
    the first token of a chat through its gateway, cold (an empty model
    cache) and warm (the same cache kept, a new fleet).
    """
    import signal
    import subprocess

    from llmgw.testing.engines import find_llama_server
    from llmgw.testing.ports import free_port, port_block, with_ports
    from llmgw.testing.tinygguf import write

    binary = find_llama_server()
    if binary is None or _olah_missing():
        return {"skipped": "no llama-server (.ci/build-llama-server), or olah-cli or git is missing"}
    work.mkdir(parents=True)
    gguf = write(work / "tiny.gguf")
    # Bytes past the tensors' data: llama-server maps the file and never
    # reads them, so only the fetch grows with the padding.
    with gguf.open("ab") as f:
        while f.tell() < pad_mib << 20:
            f.write(os.urandom(min(1 << 20, (pad_mib << 20) - f.tell())))
    size = gguf.stat().st_size
    lfs_mirror(work / "mirrors", "bench/tiny", {"model.gguf": gguf})
    cleanups = _Cleanups()
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HOME": str(work / "hf-home"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out: dict[str, Any] = {"model_bytes": size, "engine_args": " ".join(ENGINE_ARGS)}
    try:
        with olah_running(work) as endpoint:
            if endpoint is None:
                return {"skipped": "olah did not listen"}
            env["HF_ENDPOINT"] = endpoint
            # The fetch alone: the cache's, into an empty directory.
            fetched = work / "fetch-alone"
            done = subprocess.run([sys.executable, __file__, "--agent-fetch", endpoint, str(fetched),
                                   "bench/tiny", "model.gguf"], check=True, capture_output=True, env=env)
            out["fetch_s"] = round(json.loads(done.stdout.decode().strip().splitlines()[-1])["wall_s"], 3)
            [cached] = fetched.glob("*/files/model.gguf")

            # The engine's own readiness on the cached file: start to /health 200.
            port = free_port()
            t0 = time.monotonic()
            engine = subprocess.Popen([str(binary), "-m", str(cached), "--host", "127.0.0.1", "--port",
                                       str(port), *ENGINE_ARGS], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True)
            try:
                ready = _poll("llama-server's /health", lambda: _get(f"http://127.0.0.1:{port}/health") == 200, 120)
                out["engine_ready_s"] = round(ready - t0, 3)
            finally:
                os.killpg(engine.pid, signal.SIGKILL)
                engine.wait()

            cache = work / "fleet-cache"
            for leg in ("cold", "warm"):
                state = work / f"fleet-{leg}"
                state.mkdir()
                catalog = state / "catalog.toml"
                catalog.write_text(with_ports(FIRST_TOKEN_CATALOG.format(
                    binary=json.dumps(str(binary)), args=json.dumps(ENGINE_ARGS)), *port_block(cleanups)))
                gateway, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
                script = Path(sys.executable).with_name("llmgw")
                command = [str(script)] if script.exists() else [sys.executable, "-m", "llmgw.ctl.main"]
                log = (state / "fleet.log").open("wb")
                t0 = time.monotonic()
                fleet = subprocess.Popen(
                    [*command, "local", "--agents", "1", "--catalog", str(catalog), "--gateway", gateway,
                     "--admin", admin, "--heartbeat", "1", "--model-cache", str(cache)],
                    cwd=state, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True)
                try:
                    # The catalog is loaded, and the deployment made, before
                    # the admin API listens: the clock starts there.
                    loaded = _poll("the admin API", lambda admin=admin: _get(f"http://{admin}/api/v1/replicas") == 200,
                                   120)
                    # A fleet's agents run before a deployment is made: the
                    # time from this one's registration is given beside.
                    registered = _poll("the agent's registration",
                                       lambda admin=admin: b"local-1" in _body(f"http://{admin}/api/v1/nodes"), 120)
                    token = _first_token(gateway, 300)
                    out[leg] = {"process_start_to_catalog_s": round(loaded - t0, 3),
                                "catalog_to_first_token_s": round(token - loaded, 3),
                                "agent_registered_to_first_token_s": round(token - registered, 3)}
                finally:
                    fleet.send_signal(signal.SIGTERM)
                    try:
                        fleet.wait(60)
                    except subprocess.TimeoutExpired:
                        pass
                    # Whatever is left of the fleet's process group (its engines).
                    try:
                        os.killpg(fleet.pid, signal.SIGKILL)
                    except OSError:
                        pass
                    fleet.wait()
                    log.close()
                    _kill_mentioning(str(work))
    finally:
        cleanups.run()
    fetch, ready = out["fetch_s"], out["engine_ready_s"]
    out["bars"] = {
        "cold_first_token_at_most_fetch_plus_ready_plus_1s":
            out["cold"]["catalog_to_first_token_s"] <= fetch + ready + 1,
        "warm_first_token_at_most_ready_plus_1s": out["warm"]["catalog_to_first_token_s"] <= ready + 1,
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256, help="the model's size (MiB)")
    parser.add_argument("--nodes", type=int, default=8, help="0: only the fetch CPU bar")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--hub-mib", type=int, default=1024, help="the fetch CPU bar's file (MiB; 0: skip)")
    parser.add_argument("--pad-mib", type=int, default=256,
                        help="the first-token bars' model: the tiny GGUF padded to this size (MiB; 0: skip them)")
    parser.add_argument("--before", help="another llmgw tree (e.g. a git archive of main) whose hub fetch "
                                         "is measured beside this one's")
    parser.add_argument("--agent-fetch", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent_fetch:
        agent_fetch(*args.agent_fetch)
        return
    from twisted.internet import reactor
    from twisted.internet.task import react

    def body(reactor_: Any) -> Deferred[None]:
        async def go() -> None:
            result = await run(reactor_, args)
            print(json.dumps(result, indent=2))
            if args.out:
                out = Path(args.out)
                # A partial run (--nodes 0, --hub-mib 0) updates the keys it
                # measured and keeps the rest of an earlier run's file.
                merged = json.loads(out.read_text()) if out.exists() else {}
                bars = {**merged.get("bars", {}), **result.get("bars", {})}
                merged.update(result)
                merged["bars"] = bars
                out.write_text(json.dumps(merged, indent=2) + "\n")
        return Deferred.fromCoroutine(go())
    del reactor
    react(body)


if __name__ == "__main__":
    main()
