"""
The fleet as the control plane knows it: one L{FleetState} owning every
node, replica and shard record and the indexes over them (capacity, ports),
the inventory, engine signals, the event log, gateways' demand, and the
seams (interfaces) between the parts above. No transports, no clocks.
"""
