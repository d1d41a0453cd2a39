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

from twisted.application.reactors import installReactor
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


#: sub-command -> the reactor (a ``twistd --reactor`` name) it runs on when
#: the operator named none. Only the gateway's own process: its front and
#: upstream pass every proxied byte, and llmgw.reactor's epoll reactor
#: saves them a log context per event. The others run on twistd's default.
DEFAULT_REACTORS: dict[str, str] = {"gateway": "llmgw-epoll"}


def _options_for(kind: str, module: str) -> Callable[[], usage.Options]:
    def make() -> usage.Options:
        # Called when the command line names this sub-command, after
        # twistd's own options (--reactor among them) and before the
        # module, which may import the global reactor (the gateway's does,
        # through prometheus_client's Twisted support).
        install_default_reactor(kind)
        return importlib.import_module(module).Options()

    return make


def install_default_reactor(kind: str) -> str | None:
    """
    Install the reactor L{DEFAULT_REACTORS} names for C{kind} when no
    reactor is installed yet (twistd installs the one C{--reactor} names
    while it parses its options, before any sub-command's). Returns the
    name installed, or C{None} when it left things as they were: C{kind}
    has no default of its own, a reactor is installed already, or this
    platform lacks the default's (no epoll).
    """
    name = DEFAULT_REACTORS.get(kind)
    if name is None or "twisted.internet.reactor" in sys.modules:
        return None
    try:
        installReactor(name)
    except ImportError:  # no epoll (not Linux): twistd's default
        return None
    return name


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
    subCommands = [[name, None, _options_for(name, mod), doc] for name, (mod, doc) in KINDS.items()]

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
