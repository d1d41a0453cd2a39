"""
Crash classes: why a shard ended, from its exit code, the signal that ended
it and the last lines it wrote (DESIGN §15).

L{classify} is a pure function below C{control/} and C{agent/}: the agent
calls it when a shard ends, and the class travels in C{ShardStatus.crash_class}
so the control plane can hold a deployment whose profile the engine refuses
instead of restarting it in a loop.

The patterns come from the engines' own messages (sources in
C{tests/test_crash.py}, next to each sample): PyTorch's and CUDA's out of
memory errors, vLLM's and SGLang's memory and configuration refusals (both use
Python's C{argparse}), llama.cpp's C{common/arg.cpp} and C{tools/server}
messages, and the OS's "address already in use".
"""

from __future__ import annotations

import enum
import re
import signal

__all__ = ["CrashClass", "classify", "effective_signal"]


class CrashClass(enum.StrEnum):
    """
    The classes of a failure. The values are what travels on the wire and
    shows in events, the admin API and metric labels.
    """

    #: CUDA (or another accelerator) out of memory, or the host's OOM killer
    #: (a KILL, or exit 137, with out-of-memory words in the output).
    OOM = "oom"
    #: The engine refused its configuration: unknown argument, model not
    #: found, a profile it cannot run. Retrying the same profile cannot help.
    CONFIG = "config"
    #: The port the shard was given was taken.
    PORT_IN_USE = "port_in_use"
    #: The engine crashed: a fatal signal (SEGV, ABRT, BUS, ILL, FPE), a
    #: Python traceback, a C++ exception that terminated it.
    ENGINE_CRASH = "engine_crash"
    #: Killed by a signal (KILL, TERM, INT, HUP) that nobody on this side asked for.
    KILLED = "killed"
    #: Wedged: it ran requests and made no progress for its profile's
    #: C{stall_after_s} (the control plane's verdict, never the agent's).
    HUNG = "hung"
    #: The model's weights could not be put on the node. Each is the
    #: failure class of L{llmgw.models.errors}: the node's model cache
    #: cannot hold them,
    DISK_FULL = "disk_full"
    #: a file did not match the source's checksum,
    CHECKSUM = "checksum"
    #: the repository, revision, file or URL does not exist,
    NOT_FOUND = "not_found"
    #: the source refused access (no token, or one that may not read it),
    DENIED = "denied"
    #: or the fetch failed otherwise (the network, the server).
    FETCH = "fetch"
    UNKNOWN = "unknown"


#: The classes of a failure to put a shard's weights on its node: the agent
#: reports them from its model cache, never from a process's output.
FETCH_CLASSES = frozenset({CrashClass.DISK_FULL, CrashClass.CHECKSUM, CrashClass.NOT_FOUND,
                           CrashClass.DENIED, CrashClass.FETCH})


def _rx(*patterns: str) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)


_OOM = _rx(
    r"CUDA out of memory",                        # torch.OutOfMemoryError
    r"CUDA error: out of memory",                  # RuntimeError from a CUDA call
    r"CUDA_ERROR_OUT_OF_MEMORY",                   # driver API
    r"cudaErrorMemoryAllocation",
    r"cudaMalloc failed: out of memory",           # ggml-cuda
    r"HIP out of memory",                          # ROCm builds of torch
    r"OutOfMemoryError",
    r"No available memory for the cache blocks",   # vLLM
    r"Not enough memory\. Please try to increase --mem-fraction-static",  # SGLang
    r"failed to allocate \S+ buffer",              # llama.cpp: ggml_gallocr / kv cache
    r"unable to allocate \S+ buffer",              # llama.cpp: llama_model_load
    r"\bout of memory\b.*\bkill(?:ed)? process",  # kernel OOM killer, relayed
    r"\boom[-_ ]?kill",                            # "oom-kill", "OOMKilled"
    r"Cannot allocate memory",                     # ENOMEM
    r"std::bad_alloc",
    r"MemoryError",
)

# What a parent prints when its engine child was SIGKILLed (by the host's OOM
# killer or by hand: nothing here tells which, so it is "killed").
_KILLED_CHILD = _rx(
    r"exit ?code[:= ]+-9\b",                       # multiprocessing's "exitcode=-9"
    r"'EngineCore_\d+': -9",                       # vLLM: "Failed core proc(s): {...: -9}"
    r"Signal 9 \(SIGKILL\)",                       # torch.distributed.elastic
    r"died with <Signals\.SIGKILL: 9>",            # torch.multiprocessing
)

_PORT = _rx(
    r"\[Errno (?:98|48)\] .*address already in use",  # Linux 98, macOS 48
    r"\[Errno (?:98|48)\] Address already in use",
    r"address already in use",
    r"EADDRINUSE",
    r"couldn't bind HTTP server socket",               # llama.cpp tools/server
    r"could not bind to (?:address|port)",
)

_CONFIG = _rx(
    # argparse, which vLLM (FlexibleArgumentParser) and SGLang both use.
    r"error: unrecognized arguments:",
    r"error: argument \S+: (?:invalid|expected|ignored|not allowed)",
    r"error: the following arguments are required",
    r"error: ambiguous option",
    # llama.cpp common/arg.cpp
    r"error: invalid argument: ",
    r"error while handling argument",
    r"error: unknown argument",
    # model not found (Hugging Face, vLLM, llama.cpp)
    r"is not a local folder and is not a valid model identifier",
    r"Repository Not Found for url",
    r"RepositoryNotFoundError",
    r"GatedRepoError",
    r"Invalid repository ID or local directory specified",
    r"LocalEntryNotFoundError",
    r"failed to load model from",
    r"gguf_init_from_file: failed to open",
    r"error loading model: ",
    r"failed to load model",
    r"unable to load model",
    r"No such file or directory: '[^']*(?:config\.json|\.gguf|\.safetensors)'",
    # a profile the engine refuses (vLLM, SGLang)
    r"must be divisible by tensor parallel size",
    r"is larger than the maximum number of tokens that can be stored in KV cache",
    r"is greater than the derived max_model_len",
    r"Unknown quantization method",
    r"is only supported on GPUs with compute capability",
    r"\d+ validation errors? for \w*Config",     # vLLM's pydantic config classes
    r"Unsupported model architecture|Model architectures \[.*\] are not supported",
    r"llmgw: cannot run ",                        # the launcher: no such program
)

_CRASH = _rx(
    r"Traceback \(most recent call last\)",
    r"Segmentation fault",
    r"core dumped",
    r"Fatal Python error",
    r"terminate called after throwing an instance of",
    r"an illegal memory access was encountered",
    r"GGML_ASSERT",
    r"Assertion .* failed",
)

_FATAL_SIGNALS = {
    signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGSYS,
}
_KILL_SIGNALS = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}

#: Most characters of output searched, from the end: the last output is
#: already bounded, this bounds the regex work whatever a caller passes.
SEARCH_CHARS = 64 * 1024


def effective_signal(exit_code: int, sig: int) -> int:
    """
    The signal that ended a process: C{sig}, or the one a shell reports as
    exit code 128+N (C{sh -c}, container runtimes), or 0.
    """
    if sig:
        return sig
    if 128 < exit_code < 128 + 65:
        n = exit_code - 128
        if n in _FATAL_SIGNALS or n in _KILL_SIGNALS:
            return n
    return 0


def classify(exit_code: int, sig: int, last_output: str, asked: bool = False) -> CrashClass:
    """
    The class of a shard's failure.

    @param exit_code: its exit code (0 when a signal ended it).
    @param sig: the signal that ended it, or 0.
    @param last_output: the last lines it wrote.
    @param asked: the process was TERMed or KILLed on purpose (a startup
        timeout, failed health checks): its signal is then no evidence of
        being killed, only its output counts.
    """
    text = last_output[-SEARCH_CHARS:]
    sig = effective_signal(exit_code, sig)
    if _OOM.search(text):
        return CrashClass.OOM
    if _PORT.search(text):
        return CrashClass.PORT_IN_USE
    if _CONFIG.search(text):
        return CrashClass.CONFIG
    if sig in _FATAL_SIGNALS:
        return CrashClass.ENGINE_CRASH
    if sig in _KILL_SIGNALS and not asked:
        return CrashClass.KILLED
    if _CRASH.search(text):
        return CrashClass.ENGINE_CRASH
    if _KILLED_CHILD.search(text) and not asked:
        # A parent that exited because its engine child was KILLed.
        return CrashClass.KILLED
    return CrashClass.UNKNOWN
