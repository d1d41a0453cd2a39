"""
C{twistd llmgw agent --join HOST:PORT[,...] --token T --node NAME}: the options
of a node that joins, and the service that joins before it runs the agent
(L{llmgw.agent.join}).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from twisted.python import usage

from llmgw.addresses import AddressError, format_address, parse_address
from llmgw.agent.join import Joiner, JoiningAgent
from llmgw.tlsconf.jointoken import MalformedToken, parse_token
from llmgw.tlsconf.options import TLSFiles

#: Where a joined node notes the agent port the control plane named, so a
#: second run without --control dials the same place.
CONTROL_NOTE = "control-{node}.txt"


#: The exit status of an agent whose join was refused.
JOIN_REFUSED_STATUS = 2


def exit_after_stop(status: int) -> None:
    """
    End the process with C{status} once twistd has finished with it (its
    pid file removed, its logs written).

    twistd exits 0 whenever its reactor stops and offers no way to say
    otherwise, yet a refused join must not look like a clean stop to a
    supervisor (systemd, a shell loop); an exit handler is the last point
    where the status can still be set.
    """
    import atexit

    def end() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)

    atexit.register(end)


def join_addresses(given: list[str]) -> list[tuple[str, int]]:
    """
    The join listeners C{--join} names (each given, comma lists split), in order.

    @raise usage.UsageError: one is empty, not HOST:PORT, or named twice.
    """
    addresses: list[tuple[str, int]] = []
    for spec in given:
        try:
            host, port = parse_address(spec.strip(), "")
        except AddressError as e:
            raise usage.UsageError(f"--join {spec.strip()!r}: {e}") from e
        if not host or not port:
            raise usage.UsageError(f"--join {spec.strip()!r}: give HOST:PORT")
        if (host, port) in addresses:
            raise usage.UsageError(f"--join {spec.strip()!r} is given twice")
        addresses.append((host, port))
    return addresses


def join_options(options: Any) -> None:
    """
    With C{--join}: check it, C{--token} and C{--node}; default C{--certs} to
    C{STATE_DIR/certs} and C{--control} to what the join named; set
    C{options["joiner"]} when the node has no files yet (else the agent
    starts from them, as without C{--join}).

    @raise usage.UsageError: a token without C{--join}, a malformed token, no
        C{--node}, or a malformed address.
    """
    options["joiner"] = None
    options["given_control"] = bool(options["controls"])
    if not options["joins"]:
        if options["token"]:
            raise usage.UsageError("--token goes with --join HOST:PORT")
        return
    if not options["token"] or not options["node"]:
        raise usage.UsageError("--join needs --token TOKEN and --node NAME")
    try:
        token = parse_token(options["token"])
    except MalformedToken as e:
        raise usage.UsageError(f"--token: {e}") from e
    addresses = join_addresses(options["joins"])
    host, port = addresses[0]
    directory = Path(options["certs"] or Path(options["state-dir"]) / "certs")
    options["certs"] = str(directory)
    from llmgw.wire import InvalidNodeId, validate_node_id

    try:
        validate_node_id(options["node"])
    except InvalidNodeId as e:
        raise usage.UsageError(f"--node: {e}") from e
    joiner = Joiner(None, host, port, token, options["node"], directory, also=addresses[1:])
    note = directory / CONTROL_NOTE.format(node=options["node"])
    if joiner.existing() is not None:
        if not options["controls"] and note.exists():
            options["controls"].append(note.read_text().strip())
        return
    options["joiner"] = joiner
    if not options["controls"]:
        # Replaced by the agent port the control plane names when it answers.
        options["controls"].append(format_address(host, 7443))


def joining_service(options: Any, reactor: Any) -> JoiningAgent:
    """The service that joins, then runs the agent L{makeService} would have."""
    from llmgw.agent import service

    joiner: Joiner = options["joiner"]
    joiner.reactor = reactor
    given_control = bool(options.get("given_control"))

    def build(files: TLSFiles, agent_port: int) -> Any:
        options["tls"], options["node_id"], options["joiner"] = files, joiner.node_id, None
        # The agent's context, made with the joiner, given the files now.
        options["tls_context"] = joiner.agent_context
        if agent_port and not given_control:
            options["control_host"], options["control_port"] = joiner.host, agent_port
            options["control_targets"] = [(joiner.host, agent_port)]
            note = joiner.directory / CONTROL_NOTE.format(node=joiner.node_id)
            note.write_text(format_address(joiner.host, agent_port) + "\n")
        return service.makeService(options, reactor)

    def stop() -> None:
        exit_after_stop(JOIN_REFUSED_STATUS)
        if reactor.running:
            reactor.stop()

    return JoiningAgent(joiner, build, stop)
