"""
What a shard is started with, and whether it may start: the checks a start
must pass (L{refusal}, and L{weights_refusal} for one whose command llmgw
wrote from a model source), its command line (L{fill_argv}, L{launcher_args}),
its environment (L{environment}), and the process protocol that sees its
launcher's first words and its end (L{ShardProcess}). Plain functions of
the shard's spec, apart from the protocol.

Each shard runs in its own session, so its process group is its own and
C{killpg} reaches everything it forked, with stdout and stderr appended to
a log file rather than a pipe to the agent (see L{llmgw.agent.logtail}).
Every shard's environment carries C{LLMGW_SHARD_ID}, C{LLMGW_REPLICA_ID},
C{LLMGW_MODEL} and C{LLMGW_AGENT_STATE} (the agent's state directory),
which its children inherit: that is how an agent finds them after a
restart.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from llmgw.agent.processes import AGENT_MARKER, SHARD_MARKER
from llmgw.agent.shard import Shard
from llmgw.agent.state import ShardSpec, valid_shard_id
from llmgw.crash import CrashClass

# Runs in the child before the shard's own program: output to the log file,
# stdin from /dev/null, a session (and process group) of its own, then exec,
# which keeps the pid.
LAUNCHER = """\
import os, sys
log, argv = sys.argv[1], sys.argv[2:]
fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0); os.dup2(fd, 1); os.dup2(fd, 2)
os.close(fd); os.close(null)
os.setsid()
try:
    os.execvp(argv[0], argv)
except OSError as e:
    os.write(2, ("llmgw: cannot run %r: %s\\n" % (argv[0], e.strerror)).encode())
    os._exit(127)
"""

#: The refusal of a start whose command is empty.
NO_ARGV = "the command has no argv"


def refusal(spec: ShardSpec, node_gpus: set[int] | None, held: Iterable[Shard],
            port_in_use: Callable[[int], bool],
            lends: Callable[[Shard], bool] = lambda shard: False) -> str | None:
    """
    Why C{spec} cannot start, or C{None} if it can.

    @param node_gpus: the node's GPU indices, or C{None} not to check.
    @param held: the shards that hold GPUs and ports (live or stopping: a
        stopping shard's are free only once its group is empty).
    @param port_in_use: whether another process on the node has the port;
        asked last, as it is the only check that costs a system call.
    @param lends: whether a held shard's GPUs may be shared with a new
        shard (its engine sleeps, and the control plane lent its memory).
    """
    if not valid_shard_id(spec.shard_id):
        return f"shard id {spec.shard_id!r} is not usable (letters, digits, '.', '_', '-')"
    if not spec.argv or not spec.argv[0]:
        return NO_ARGV
    if not 0 < spec.port < 65536:
        return f"port {spec.port} is not a usable port"
    if len(set(spec.gpu_indices)) != len(spec.gpu_indices):
        return f"GPU indices repeat: {list(spec.gpu_indices)}"
    if node_gpus is not None:
        missing = sorted(set(spec.gpu_indices) - node_gpus)
        if missing:
            have = ",".join(map(str, sorted(node_gpus))) or "none"
            return f"GPU {','.join(map(str, missing))} does not exist on this node (it has {have})"
    for other in held:
        if other.spec.port == spec.port:
            return f"port {spec.port} is in use by shard {other.shard_id}"
        shared = sorted(set(other.spec.gpu_indices) & set(spec.gpu_indices))
        if shared and not lends(other):
            return (f"GPU {','.join(map(str, shared))} is in use by shard "
                    f"{other.shard_id}")
    if port_in_use(spec.port):
        return f"port {spec.port} is already in use by another process on this node"
    return None


def refusal_class(problem: str) -> CrashClass:
    """
    The crash class of a refused start. A refusal is no crash, but the
    control plane still needs to know whether a retry can help: a taken
    port may free up, an empty command never will.
    """
    if problem.startswith("port ") and "in use" in problem:
        return CrashClass.PORT_IN_USE
    if problem == NO_ARGV:
        return CrashClass.CONFIG
    return CrashClass.UNKNOWN


class ProgramMissing(LookupError):
    """
    An engine's program cannot be run on this node; the message names it
    and says where it was looked for.
    """


def find_program(program: str, search_path: str) -> str:
    """
    The executable C{program} names: itself when it holds a C{/}, else the
    first match on C{search_path} (a C{PATH} value), as C{execvp} finds it.

    @raise ProgramMissing: there is no such executable.
    """
    if "/" in program:
        if os.path.isfile(program) and os.access(program, os.X_OK):
            return program
        raise ProgramMissing(f"engine program {program!r} is not an executable file on this node")
    found = shutil.which(program, path=search_path)
    if found is None:
        raise ProgramMissing(
            f"engine program {program!r} is not on this agent's PATH ({search_path or 'empty'}); "
            "install it there, or name it with the profile's 'program'"
        )
    return found


#: The schemes whose weights the agent fetches into its model cache.
FETCHED_SCHEMES = ("hf", "https")


def needs_fetch(spec: ShardSpec) -> bool:
    """
    Whether C{spec}'s weights or LoRA adapters come through the node's
    model cache (an C{hf://} or C{https://} source) before the shard can
    start.
    """
    return (spec.source is not None and spec.source.scheme in FETCHED_SCHEMES
            or any(a.scheme in FETCHED_SCHEMES for _, a in spec.adapters))


def local_weights(spec: ShardSpec) -> str:
    """
    Where the weights of C{spec}'s source are on this node without
    fetching: a C{file://} source's path; "" for any other, or none.
    """
    source = spec.source
    return source.path if source is not None and source.scheme == "file" else ""


def weights_refusal(spec: ShardSpec, env: Mapping[str, str], python: str) -> str | None:
    """
    Why a shard whose command llmgw wrote from a model source cannot start
    on this node, or C{None} (always for a spec without a source): a
    source that is not well-formed, a C{file://} path that is not here, an
    engine program that is not on the shard's C{PATH} (C{env}'s). Each is
    the catalog's or the node's setup, which a retry cannot mend; all are
    checked before a fetch, so a shard that cannot run fetches nothing.
    """
    source = spec.source
    if source is None:
        return None
    problem = source.problem()
    if problem is not None:
        return f"the model source is not usable: {problem}"
    if source.scheme == "file" and not os.path.exists(source.path):
        return f"model {source.path} (source {source.uri}) is not on this node"
    if not spec.argv:
        return NO_ARGV
    try:
        find_program(spec.argv[0].replace("{python}", python), env.get("PATH", os.defpath))
    except ProgramMissing as e:
        return str(e)
    return None


def fill_argv(spec: ShardSpec, python: str, host: str, weights: str = "") -> list[str]:
    """
    The shard's argv with its placeholders filled: C{{python}}, C{{port}},
    C{{rank}}, C{{world_size}}, C{{leader}}, C{{model}}, C{{shard_id}},
    C{{replica_id}}, C{{gpus}} (comma-separated), C{{host}} (the address
    the agent advertises, where the control plane left it to the agent) and,
    for a spec with a model source, C{{weights}} (their path on the node).
    """
    values = {
        "{python}": python,
        "{port}": str(spec.port),
        "{rank}": str(spec.rank),
        "{world_size}": str(spec.world_size),
        "{leader}": spec.leader_address,
        "{model}": spec.model,
        "{shard_id}": spec.shard_id,
        "{replica_id}": spec.replica_id,
        "{gpus}": ",".join(map(str, spec.gpu_indices)),
        "{host}": host,
    }
    if spec.source is not None:
        values["{weights}"] = weights
    out = []
    for arg in spec.argv:
        for key, value in values.items():
            if key in arg:
                arg = arg.replace(key, value)
        out.append(arg)
    return out


def launcher_args(python: str, log_path: Path, argv: list[str]) -> list[str]:
    """
    The argv that runs L{LAUNCHER} (isolated from the user's site
    packages), which runs C{argv} with its output appended to C{log_path}.
    """
    return [python, "-I", "-c", LAUNCHER, str(log_path), *argv]


def environment(spec: ShardSpec, base_env: Mapping[str, str], marker: str) -> dict[str, str]:
    """
    The shard's whole environment: C{base_env} (a few of the agent's
    variables), the command's env, and ours, which win. C{marker} (the
    agent's state directory) is set as C{LLMGW_AGENT_STATE} unless empty.
    """
    env = dict(base_env)
    env.update(spec.env)
    env.update({
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, spec.gpu_indices)),
        "LLMGW_PORT": str(spec.port),
        "LLMGW_RANK": str(spec.rank),
        "LLMGW_WORLD_SIZE": str(spec.world_size),
        "LLMGW_LEADER": spec.leader_address,
        SHARD_MARKER: spec.shard_id,
        "LLMGW_REPLICA_ID": spec.replica_id,
        "LLMGW_MODEL": spec.model,
        "LLMGW_PROFILE": spec.profile,
    })
    if marker:
        env[AGENT_MARKER] = marker
    return env


class ShardProcess(ProcessProtocol):
    """
    The protocol of a shard's main process: keeps what the launcher writes
    before its output goes to the log file, and calls C{ended(shard,
    exit_code, signal)} when the process has ended (all its pipes closed).
    """

    def __init__(self, shard: Shard, ended: Callable[[Shard, int, int], None]):
        self.shard = shard
        self.ended = ended

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        self.shard.add_startup_output(data.decode("utf-8", "replace"))

    def processEnded(self, reason: Failure) -> None:
        value = reason.value
        code = getattr(value, "exitCode", None)
        sig = getattr(value, "signal", None)
        self.ended(self.shard, code if code is not None else 0, sig or 0)
