"""
The decision core: functions of (state, input, now) that return state
changes, commands and events (placement, adoption, expiry, failures and
backoff, scaling and autoscaling, lifecycle), the catalog and its
validation, and what an operator set that must be kept. Nothing here
dispatches, reads a clock or touches a transport.
"""
