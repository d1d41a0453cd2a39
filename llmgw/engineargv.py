"""
The command lines llmgw writes for the engines it can launch (DESIGN §15,
§19): a deployment that names its model by C{source} and a profile that
names its C{engine} need no C{command}; L{build_argv} makes one from the
weights' path, the address, the tensor parallelism, the served model name
and the deployment's own C{args}, which come last.

The values are usually placeholders (C{{weights}}, C{{host}}, C{{port}},
C{{model}}) that the control plane and the agent fill per shard, exactly
as in a hand-written C{command}. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Where the weights are, filled by the agent once they are on the node: a
#: file's path for a one-file source, else the directory.
WEIGHTS = "{weights}"

#: Each launchable engine's program when the profile names none, looked up
#: on the agent's PATH. SGLang is a Python module: its program is the
#: interpreter it is installed in.
DEFAULT_PROGRAMS = {"vllm": "vllm", "sglang": "python3", "llamacpp": "llama-server"}

#: The engines whose command line llmgw can write.
LAUNCHABLE = tuple(sorted(DEFAULT_PROGRAMS))


def build_argv(engine: str, *, weights: str, host: str, port: str, served_name: str,
               tensor_parallel: int, args: Sequence[str] = (), program: str = "",
               metrics: bool = True) -> tuple[str, ...]:
    """
    The argv that serves C{weights} with C{engine} on C{host}:C{port}
    under the name C{served_name}, on C{tensor_parallel} GPUs, with
    C{args} appended (an engine whose parser keeps the last value of a flag
    given twice lets C{args} override ours).

    vLLM: C{vllm serve WEIGHTS ... --tensor-parallel-size N}. SGLang:
    C{python3 -m sglang.launch_server --model-path WEIGHTS ... --tp-size N}
    and, with C{metrics}, C{--enable-metrics}. llama.cpp: C{llama-server
    -m WEIGHTS ... --alias NAME} and, with C{metrics}, C{--metrics}; it
    spreads layers over every GPU it is given (C{CUDA_VISIBLE_DEVICES}), so
    it takes no parallelism flag, and offloads what fits by default (C{-ngl
    0} in C{args} keeps it on the CPU).

    @param program: the engine's executable; "" for L{DEFAULT_PROGRAMS}.
    @raise ValueError: C{engine} is not one of L{LAUNCHABLE}, or
        C{tensor_parallel} is below 1.
    """
    if engine not in DEFAULT_PROGRAMS:
        raise ValueError(f"llmgw cannot write a command line for engine {engine!r} "
                         f"(it can for: {', '.join(LAUNCHABLE)})")
    if tensor_parallel < 1:
        raise ValueError(f"tensor parallelism must be at least 1, not {tensor_parallel}")
    exe = program or DEFAULT_PROGRAMS[engine]
    address = ["--host", host, "--port", port]
    if engine == "vllm":
        # vLLM's /metrics is always on.
        argv = [exe, "serve", weights, *address, "--served-model-name", served_name,
                "--tensor-parallel-size", str(tensor_parallel)]
    elif engine == "sglang":
        argv = [exe, "-m", "sglang.launch_server", "--model-path", weights, *address,
                "--served-model-name", served_name, "--tp-size", str(tensor_parallel)]
        if metrics:
            argv.append("--enable-metrics")
    else:
        argv = [exe, "-m", weights, *address, "--alias", served_name]
        if metrics:
            argv.append("--metrics")
    return (*argv, *args)
