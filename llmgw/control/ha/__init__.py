"""
A highly available control plane on etcd: election and fencing, one
member's shell, the operator's state shared through etcd, and the leader's
routing table published for the members that do not lead.
"""
