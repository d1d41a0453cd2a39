"""
The thin shell around the core: the reconciler service that feeds it
reports and ticks and sends what it decides, the agent service on the
mutual-TLS stream with its limits, trust material reloads, and metrics.
"""
