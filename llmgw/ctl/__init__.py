"""The operator CLI, ``llmgw ctl``."""
