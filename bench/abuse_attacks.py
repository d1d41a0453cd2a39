"""
The attacks of L{bench.abuse}, one a process (C{sys.argv[1]} is a JSON
config naming its C{kind}), on asyncio. Each dials from C{source} (by
default 127.0.0.2, another loopback address than the well-behaved
client's 127.0.0.1, so that a per-address cap may refuse the attacker and
not the client), runs until its stdin says C{stop}, then prints one JSON
document of what it did. A connection the server closes is opened again:
an attacker persists.

* C{pipeline}: one connection with a small receive buffer that writes
  pipelined requests answered by the server itself (keyless C{GET
  /v1/models}, 401, and C{GET}s of a path that is not there, 404, on a
  gateway; over mutual TLS on the admin API, C{GET /api/v1/whoami} and a
  404) and never reads.
* C{slow_bodies}: C{connections} keyless connections, each a request head
  with a C{Content-Length} and then one body byte every C{trickle_s}
  (one the server closes is opened again C{trickle_s} later).
* C{tls_flood}: C{connections} connections that send a TLS ClientHello and
  never go on, and as many that open TCP and send nothing.
* C{big_json}: the largest bodies the gateway accepts (C{max_body}),
  adversarial (a million tiny keys, deep nesting, a quarter million small
  messages; C{model} last), sent with a valid key, C{concurrency} at once.
* C{ws_flood}: the admin watch socket over mutual TLS, C{requests}
  requests sent as fast as the socket takes them, nothing read.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import ssl
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

Stats = Counter[str]


class Attack:
    """
    What every attack shares: the config, the counters, the stop event,
    and dialling from the attacker's address.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.host = "127.0.0.1"
        self.port = int(config["port"])
        self.source = config.get("source", "127.0.0.2")
        self.stats: Stats = Counter()
        self.statuses: Counter[str] = Counter()
        self.stop = asyncio.Event()
        self.open = 0
        self.tls: ssl.SSLContext | None = None
        if config.get("tls"):
            files = config["tls"]
            self.tls = ssl.create_default_context(cafile=files["ca"])
            self.tls.load_cert_chain(files["cert"], files["key"])

    def opened(self) -> None:
        self.open += 1
        self.stats["connections_opened"] += 1
        self.stats["open_peak"] = max(self.stats["open_peak"], self.open)

    def closed(self) -> None:
        self.open -= 1

    async def dial(self, rcvbuf: int = 0, tls: bool = False) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if rcvbuf:
                # Before connect, so the window the kernel offers is small too.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            sock.bind((self.source, 0))
            await loop.sock_connect(sock, (self.host, self.port))
        except BaseException:
            sock.close()
            raise
        if tls:
            return await asyncio.open_connection(sock=sock, ssl=self.tls, server_hostname=self.host)
        return await asyncio.open_connection(sock=sock)

    async def pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except TimeoutError:
            pass

    def note_answer(self, data: bytes) -> None:
        """
        Count the status of a response whose first bytes are C{data}.
        """
        if data.startswith(b"HTTP/1."):
            self.statuses[data[9:12].decode("ascii", "replace")] += 1

    async def run(self) -> None:
        raise NotImplementedError

    def report(self) -> dict[str, Any]:
        return {"kind": self.config["kind"], **self.stats, "statuses": dict(self.statuses)}


def pause_reading(writer: asyncio.StreamWriter) -> None:
    """
    Read nothing more on this connection: what the server sends stays in
    the kernel's buffers (a small one, for a pipelining attacker), so its
    answers wait on its side.
    """
    transport = writer.transport
    assert isinstance(transport, asyncio.ReadTransport)
    transport.pause_reading()


class Pipeline(Attack):
    """
    One connection, pipelined requests, nothing read.
    """

    def requests(self) -> bytes:
        host = f"127.0.0.1:{self.port}".encode()
        if self.config.get("tls"):
            one = (b"GET /api/v1/whoami HTTP/1.1\r\nHost: %s\r\n\r\n"
                   b"GET /api/v1/nowhere HTTP/1.1\r\nHost: %s\r\n\r\n") % (host, host)
        else:
            # GETs: a keyless POST is answered 401 and its connection
            # closed, which would end the attack by itself.
            one = (b"GET /v1/models HTTP/1.1\r\nHost: %s\r\n\r\n"
                   b"GET /v1/nowhere HTTP/1.1\r\nHost: %s\r\n\r\n") % (host, host)
        return one * 32

    async def run(self) -> None:
        batch = self.requests()
        while not self.stop.is_set():
            try:
                reader, writer = await self.dial(rcvbuf=int(self.config.get("rcvbuf", 4096)),
                                                 tls=bool(self.config.get("tls")))
            except OSError:
                self.stats["connect_errors"] += 1
                await self.pause(0.5)
                continue
            pause_reading(writer)
            self.opened()
            try:
                while not self.stop.is_set():
                    writer.write(batch)
                    self.stats["requests_sent"] += 64
                    self.stats["bytes_sent"] += len(batch)
                    drain = asyncio.ensure_future(writer.drain())
                    stopped = asyncio.ensure_future(self.stop.wait())
                    await asyncio.wait([drain, stopped], return_when=asyncio.FIRST_COMPLETED)
                    stopped.cancel()
                    if not drain.done():
                        drain.cancel()
                        break
                    drain.result()
            except (OSError, ssl.SSLError):
                self.stats["closed_by_server"] += 1
            finally:
                self.closed()
                writer.transport.abort()


class SlowBodies(Attack):
    """
    Keyless requests whose bodies trickle, one byte every C{trickle_s}.
    """

    async def one(self, index: int) -> None:
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n") % self.port
        trickle = float(self.config.get("trickle_s", 5.0))
        await self.pause(index / float(self.config.get("dial_rate", 500)))
        while not self.stop.is_set():
            try:
                reader, writer = await self.dial()
            except OSError:
                self.stats["connect_errors"] += 1
                await self.pause(0.5)
                continue
            self.opened()
            try:
                writer.write(head)
                while not self.stop.is_set():
                    try:
                        data = await asyncio.wait_for(reader.read(65536), trickle)
                    except TimeoutError:
                        writer.write(b" ")
                        self.stats["body_bytes_sent"] += 1
                        continue
                    if not data:
                        self.stats["closed_by_server"] += 1
                        break
                    self.note_answer(data)
            except (OSError, ssl.SSLError):
                self.stats["closed_by_server"] += 1
            finally:
                self.closed()
                writer.transport.abort()
            # Opened again at the trickle's pace: a slow attacker, not a
            # connection flood, whatever the server does with its heads.
            await self.pause(trickle)

    async def run(self) -> None:
        await asyncio.gather(*(self.one(i) for i in range(int(self.config.get("connections", 1000)))))


def client_hellos(count: int) -> list[bytes]:
    """
    C{count} distinct TLS ClientHellos, as a client's first flight.
    """
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    out = []
    for _ in range(count):
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = ctx.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
        try:
            obj.do_handshake()
        except ssl.SSLWantReadError:
            pass
        out.append(outgoing.read())
    return out


class TLSFlood(Attack):
    """
    Handshakes begun and never finished, and connections that say nothing.
    """

    async def one(self, index: int, hello: bytes | None) -> None:
        await self.pause(index / float(self.config.get("dial_rate", 1000)))
        while not self.stop.is_set():
            try:
                reader, writer = await self.dial()
            except OSError:
                self.stats["connect_errors"] += 1
                await self.pause(0.5)
                continue
            self.opened()
            self.stats["hellos_sent" if hello else "silent_opened"] += 1
            try:
                if hello:
                    writer.write(hello)
                while not self.stop.is_set():
                    read = asyncio.ensure_future(reader.read(65536))
                    stopped = asyncio.ensure_future(self.stop.wait())
                    await asyncio.wait([read, stopped], return_when=asyncio.FIRST_COMPLETED)
                    stopped.cancel()
                    if not read.done():
                        read.cancel()
                        break
                    if not read.result():
                        self.stats["closed_by_server"] += 1
                        break
            except OSError:
                self.stats["closed_by_server"] += 1
            finally:
                self.closed()
                writer.transport.abort()
            await self.pause(0.2)

    async def run(self) -> None:
        n = int(self.config.get("connections", 1000))
        hellos = client_hellos(16)
        # Interleaved, so both kinds ramp up together.
        jobs = [self.one(2 * i, hellos[i % len(hellos)]) for i in range(n)]
        jobs += [self.one(2 * i + 1, None) for i in range(n)]
        await asyncio.gather(*jobs)


def big_bodies(max_body: int, model: str) -> dict[str, bytes]:
    """
    Three adversarial JSON bodies of at most C{max_body} bytes, C{model}
    last so that whoever looks for it reads the whole body first.
    """
    size = max_body - 256
    head = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, '
    tail = b', "model": "%s"}' % model.encode()
    keys = bytearray(head + b'"x": {')
    i = 0
    while len(keys) < size - len(tail) - 24:
        keys += b'"%x":0,' % i
        i += 1
    keys[-1:] = b"}"
    depth = (size - len(head) - len(tail) - 8) // 2
    deep = head + b'"x": ' + b"[" * depth + b"]" * depth + tail
    one = b'{"role":"user","content":"a"},'
    count = (size - 64 - len(tail)) // len(one)
    messages = b'{"max_tokens": 1, "messages": [' + (one * count)[:-1] + b"]" + tail
    return {"many_keys": bytes(keys + tail), "deep": deep, "many_messages": messages}


class BigJSON(Attack):
    """
    The largest adversarial bodies, with a valid key, one after another on
    C{concurrency} connections.
    """

    async def one(self, bodies: list[tuple[str, bytes]], offset: int) -> None:
        key = self.config["key"].encode()
        i = offset
        while not self.stop.is_set():
            name, body = bodies[i % len(bodies)]
            i += 1
            head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nAuthorization: Bearer %s\r\n"
                    b"Content-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
                    % (self.port, key, len(body)))
            t0 = time.monotonic()
            try:
                reader, writer = await self.dial()
            except OSError:
                self.stats["connect_errors"] += 1
                await self.pause(0.5)
                continue
            self.opened()
            try:
                writer.write(head + body)
                await writer.drain()
                answer = await reader.read()
                self.note_answer(answer[:16])
                self.stats[f"sent_{name}"] += 1
                self.stats["body_bytes_sent"] += len(body)
                took = time.monotonic() - t0
                self.stats["slowest_answer_ms"] = max(self.stats["slowest_answer_ms"], int(took * 1000))
            except (OSError, ssl.SSLError):
                self.stats["closed_by_server"] += 1
            finally:
                self.closed()
                writer.transport.abort()

    async def run(self) -> None:
        built = big_bodies(int(self.config.get("max_body", 8 * 1024 * 1024)), self.config["model"])
        self.stats["body_sizes"] = 0
        self.sizes = {name: len(b) for name, b in built.items()}
        bodies = list(built.items())
        await asyncio.gather(*(self.one(bodies, k) for k in range(int(self.config.get("concurrency", 2)))))

    def report(self) -> dict[str, Any]:
        out = super().report()
        out.pop("body_sizes", None)
        out["body_bytes"] = getattr(self, "sizes", {})
        return out


def ws_frame(payload: bytes) -> bytes:
    """
    A client's masked text frame (a zero mask: any mask is valid to the
    server, and this one costs the attacker nothing).
    """
    n = len(payload)
    if n < 126:
        length = bytes([0x80 | n])
    else:
        length = bytes([0x80 | 126]) + n.to_bytes(2, "big")
    return b"\x81" + length + b"\0\0\0\0" + payload


class WSFlood(Attack):
    """
    The admin watch socket, flooded with requests, nothing read.
    """

    async def run(self) -> None:
        path = self.config.get("path", "/api/v1/status")
        count = int(self.config.get("requests", 20000))
        frames = b"".join(
            ws_frame(json.dumps({"type": "request", "id": i, "method": "GET", "path": path}).encode())
            for i in range(count)
        )
        upgrade = (b"GET /api/v1/watch HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nUpgrade: websocket\r\n"
                   b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                   b"Sec-WebSocket-Version: 13\r\n\r\n") % self.port
        while not self.stop.is_set():
            try:
                reader, writer = await self.dial(tls=True)
                writer.write(upgrade)
                answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            except (OSError, ssl.SSLError, asyncio.IncompleteReadError, TimeoutError) as e:
                self.stats[f"upgrade_failed_{type(e).__name__}"] += 1
                await self.pause(1.0)
                continue
            self.note_answer(answer)
            pause_reading(writer)
            self.opened()
            try:
                for start in range(0, len(frames), 65536):
                    if self.stop.is_set():
                        break
                    writer.write(frames[start:start + 65536])
                    await writer.drain()
                else:
                    self.stats["requests_sent"] += count
                    self.stats["rounds"] += 1
                await self.stop.wait()
            except (OSError, ssl.SSLError):
                self.stats["closed_by_server"] += 1
            finally:
                self.closed()
                writer.transport.abort()
            await self.pause(1.0)


KINDS: dict[str, type[Attack]] = {
    "pipeline": Pipeline, "slow_bodies": SlowBodies, "tls_flood": TLSFlood, "big_json": BigJSON,
    "ws_flood": WSFlood,
}


async def main_async(config: dict[str, Any], wait_stop: Callable[[], Awaitable[None]]) -> dict[str, Any]:
    attack = KINDS[config["kind"]](config)
    task = asyncio.ensure_future(attack.run())
    t0 = time.monotonic()
    await wait_stop()
    attack.stop.set()
    try:
        await asyncio.wait_for(task, 10)
    except TimeoutError:
        attack.stats["unfinished_at_stop"] += 1
    out = attack.report()
    out["ran_s"] = round(time.monotonic() - t0, 1)
    return out


def main() -> None:
    config = json.loads(sys.argv[1])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    async def wait_stop() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def read() -> None:
            for line in sys.stdin:
                if line.strip() == "stop":
                    break
            loop.call_soon_threadsafe(done.set)

        threading.Thread(target=read, daemon=True).start()
        print("ready", flush=True)
        await done.wait()

    report = asyncio.run(main_async(config, wait_stop))
    print(json.dumps(report), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
