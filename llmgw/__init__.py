"""llmgw: keeps LLM inference replicas running on a GPU fleet and routes traffic to them."""

__version__ = "0.1.0"
