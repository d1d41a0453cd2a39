"""
A client of llmgw's admin API for ops tooling, written once on txaio and
autobahn: the same L{FleetClient} runs under Twisted and under asyncio.

Everything travels over one WebSocket, the admin API's watch stream
(C{/api/v1/watch}): reads and commands are request/response messages that
the admin API answers with the handlers behind its REST endpoints, and
L{FleetClient.watch} / C{async for message in client} yield the stream's
own messages. Choose the framework before using it, as txaio asks:
C{txaio.use_twisted()} or C{txaio.use_asyncio()} (the client picks Twisted
when the reactor is already imported, else asyncio).
"""

from llmgw.client.fleet import FleetClient, FleetError

__all__ = ["FleetClient", "FleetError"]
