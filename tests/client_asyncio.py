"""
The asyncio half of L{tests.test_client}: run as
C{python -m tests.client_asyncio URL [CA CERT KEY]} against a control plane
on loopback, it drives every method of L{llmgw.client.FleetClient} under
asyncio and prints what it got as one JSON document (not a test module:
txaio's framework is chosen once per process).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import txaio

txaio.use_asyncio()

from llmgw.client import FleetClient, FleetError  # noqa: E402


async def main(url: str, tls: list[str]) -> dict[str, Any]:
    ca, cert, key = tls if tls else (None, None, None)
    client = FleetClient(url, ca=ca, cert=cert, key=key, timeout=10)
    out: dict[str, Any] = {"framework": "asyncio" if txaio.using_asyncio else "twisted"}
    out["nodes"] = await client.nodes()
    out["deployments"] = await client.deployments()
    out["replicas"] = await client.replicas()
    out["events"] = await client.events(0)
    out["scale"] = await client.scale("demo", 0)
    try:
        await client.cordon("no-such-node")
    except FleetError as e:
        out["cordon_error"] = [e.status, e.reason]
    try:
        await client.drain("no-such-node")
    except FleetError as e:
        out["drain_error"] = [e.status, e.reason]
    out["reload"] = await client.reload()
    seen = []
    stream = client.__aiter__()  # queue the stream's messages from here on
    await client.scale("demo", 1)
    async for message in stream:
        seen.append(message["type"])
        if message["type"] == "deployment" and message["deployment"]["desired"] == 1:
            out["watched_deployment"] = message["deployment"]
            break
    out["seen"] = seen
    await client.close()
    return out


if __name__ == "__main__":
    result = asyncio.run(asyncio.wait_for(main(sys.argv[1], sys.argv[2:]), 30))
    print(json.dumps(result))
