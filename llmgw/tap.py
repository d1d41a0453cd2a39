"""
``twistd llmgw``: one Options with a sub-command per process kind.

Each sub-command lives in its own module, which defines ``Options`` (a
``twisted.python.usage.Options``) and ``makeService(options, reactor=None)``
returning an ``IService``. They are imported only when chosen, so a missing
optional dependency of one kind does not break the others.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from twisted.application.service import IService
from twisted.python import usage

from llmgw.options import Options as BaseOptions

#: sub-command name -> (module, one-line description)
KINDS: dict[str, tuple[str, str]] = {
    "control": ("llmgw.control.service", "the control plane: agent stream, reconciler, APIs"),
    "agent": ("llmgw.agent.service", "the node agent: GPU discovery and shard supervisor"),
    "local": ("llmgw.local", "the whole system on this machine: control plane, agents, demo"),
    "gateway": ("llmgw.gateway.service", "a gateway in its own process, following a control plane"),
}


def _options_for(module: str) -> Callable[[], usage.Options]:
    def make() -> usage.Options:
        # Before the module (which may import the reactor): llmgw's own
        # processes run on llmgw.reactor's, unless twistd --reactor (parsed
        # before this) chose one.
        try:
            from llmgw.reactor import install_default
        except ImportError:  # no epoll (not Linux): twistd's default
            pass
        else:
            install_default()
        return importlib.import_module(module).Options()

    return make


class Options(BaseOptions):
    """
    C{twistd llmgw}'s options: a sub-command per process kind, and
    C{--version} (llmgw's and Twisted's; twistd's own C{--version}, before
    C{llmgw}, prints Twisted's alone).

    Under twistd (this is then a sub-command of twistd's own options, its
    C{parent}), a usage error is printed first and alone, with a pointer to
    C{--help}, and the process exits 1: twistd would print the whole help
    with the useful line last. Parsed on its own, a usage error is raised
    as usual.
    """

    synopsis = "[options] {" + "|".join(KINDS) + "} [options]"
    subCommands = [[name, None, _options_for(mod), doc] for name, (mod, doc) in KINDS.items()]

    def parseOptions(self, options: Any = None) -> None:
        try:
            super().parseOptions(options)
        except usage.UsageError as e:
            if self.parent is None:
                raise
            sys.stderr.write(usage_error_text(e, self.subCommand))
            sys.stderr.flush()
            raise SystemExit(1) from None

    def postOptions(self) -> None:
        if self.subCommand is None:
            raise usage.UsageError("choose one of: " + ", ".join(KINDS))


def usage_error_text(error: Exception, sub_command: str | None) -> str:
    """
    What C{twistd llmgw} prints for a usage error: the error on the first
    line, then where the help is.
    """
    command = "twistd llmgw" + (f" {sub_command}" if sub_command else "")
    return f"{command}: {error}\nsee `{command} --help`\n"


def makeService(options: Options, reactor: Any = None) -> IService:
    assert options.subCommand is not None
    module = importlib.import_module(KINDS[options.subCommand][0])
    return module.makeService(options.subOptions, reactor=reactor)  # type: ignore[no-any-return]
