"""
The ``twistd --reactor llmgw-epoll`` dropin: one Reactor line pointing at
``llmgw.reactor`` (whose ``install()`` installs its LeanEPollReactor).

``twistd llmgw gateway`` runs on it when the operator names no reactor
(see ``llmgw.tap``); every other process runs on twistd's default unless
``--reactor llmgw-epoll`` picks it. Linux only: elsewhere
``twistd --help-reactors`` lists it as missing a dependency.
"""

from twisted.application.reactors import Reactor

llmgw_epoll = Reactor(
    "llmgw-epoll",
    "llmgw.reactor",
    "epoll(7), without the legacy log context per event (the gateway's default).",
)
