"""The ``twistd llmgw`` dropin: one ServiceMaker pointing at ``llmgw.tap``."""

from twisted.application.service import ServiceMaker

llmgw = ServiceMaker(
    "llmgw",
    "llmgw.tap",
    "LLM fleet control plane, node agent, gateway and local fleet",
    "llmgw",
)
