"""
A Twisted-native etcd v3 client over etcd's JSON gateway (DESIGN §17).

etcd serves its gRPC API as JSON over HTTP (the grpc-gateway) on the same
client port: C{POST /v3/kv/range} with C{{"key": base64}} and so on. This
package speaks that with C{treq}, so nothing blocks the reactor and no gRPC
stack is needed. Keys and values are bytes here and base64 on the wire;
the gateway writes 64-bit integers as strings, which are read back as ints.

The path prefix is C{/v3/}: etcd 3.4 (Debian's) serves C{/v3/} and the
deprecated C{/v3beta/}, and no longer C{/v3alpha/}; 3.5 serves only
C{/v3/}.

The package: L{llmgw.etcd.client} (L{EtcdClient}, which members it asks
and what a failure means), L{llmgw.etcd.kv} (keys, values and transaction
parts), L{llmgw.etcd.watch} (a streamed watch) and L{llmgw.etcd.errors}.
Every name other code uses is importable from C{llmgw.etcd} itself.
"""

from llmgw.etcd.client import API_PREFIX, DEFAULT_TIMEOUT, MAX_RESPONSE, EtcdClient, as_deferred
from llmgw.etcd.errors import (
    GRPC_FAILED_PRECONDITION,
    GRPC_NOT_FOUND,
    EtcdError,
    EtcdTLSError,
    EtcdUnavailable,
    tls_problem,
)
from llmgw.etcd.kv import (
    Compare,
    Delete,
    KeyValue,
    Op,
    Put,
    Range,
    TxnResult,
    WatchEvent,
    b64,
    prefix_end,
    unb64,
)
from llmgw.etcd.watch import MAX_WATCH_MESSAGE, Watch

__all__ = [
    "API_PREFIX", "DEFAULT_TIMEOUT", "GRPC_FAILED_PRECONDITION", "GRPC_NOT_FOUND", "MAX_RESPONSE",
    "MAX_WATCH_MESSAGE", "Compare", "Delete", "EtcdClient", "EtcdError", "EtcdTLSError",
    "EtcdUnavailable", "KeyValue", "Op", "Put", "Range", "TxnResult", "Watch", "WatchEvent",
    "as_deferred", "b64", "prefix_end", "tls_problem", "unb64",
]
