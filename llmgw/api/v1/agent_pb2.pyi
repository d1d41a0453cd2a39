from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentMessage(_message.Message):
    __slots__ = ("register", "heartbeat", "shard", "certificate_request")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    register: Register
    heartbeat: Heartbeat
    shard: ShardStatus
    certificate_request: CertificateRequest
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., shard: _Optional[_Union[ShardStatus, _Mapping]] = ..., certificate_request: _Optional[_Union[CertificateRequest, _Mapping]] = ...) -> None: ...

class ControlMessage(_message.Message):
    __slots__ = ("ack", "start", "stop", "drain", "prefetch", "drop", "certificate_issued", "load_adapter", "sleep")
    ACK_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_ISSUED_FIELD_NUMBER: _ClassVar[int]
    LOAD_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    SLEEP_FIELD_NUMBER: _ClassVar[int]
    ack: Ack
    start: StartShard
    stop: StopShard
    drain: DrainShard
    prefetch: PrefetchModel
    drop: DropModel
    certificate_issued: CertificateIssued
    load_adapter: LoadAdapter
    sleep: SleepShard
    def __init__(self, ack: _Optional[_Union[Ack, _Mapping]] = ..., start: _Optional[_Union[StartShard, _Mapping]] = ..., stop: _Optional[_Union[StopShard, _Mapping]] = ..., drain: _Optional[_Union[DrainShard, _Mapping]] = ..., prefetch: _Optional[_Union[PrefetchModel, _Mapping]] = ..., drop: _Optional[_Union[DropModel, _Mapping]] = ..., certificate_issued: _Optional[_Union[CertificateIssued, _Mapping]] = ..., load_adapter: _Optional[_Union[LoadAdapter, _Mapping]] = ..., sleep: _Optional[_Union[SleepShard, _Mapping]] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("protocol_version", "node_id", "agent_version", "gpus", "fabrics", "running_shards", "certificate_not_after", "stray_processes", "advertise_address", "cached_models", "peer_address", "cache_capacity", "cache_free")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    FABRICS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_NOT_AFTER_FIELD_NUMBER: _ClassVar[int]
    STRAY_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    ADVERTISE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHED_MODELS_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_FREE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    node_id: str
    agent_version: str
    gpus: _containers.RepeatedCompositeFieldContainer[GPU]
    fabrics: _containers.RepeatedCompositeFieldContainer[Fabric]
    running_shards: _containers.RepeatedCompositeFieldContainer[RunningShard]
    certificate_not_after: int
    stray_processes: _containers.RepeatedCompositeFieldContainer[StrayProcess]
    advertise_address: str
    cached_models: _containers.RepeatedCompositeFieldContainer[CachedModel]
    peer_address: str
    cache_capacity: int
    cache_free: int
    def __init__(self, protocol_version: _Optional[int] = ..., node_id: _Optional[str] = ..., agent_version: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[GPU, _Mapping]]] = ..., fabrics: _Optional[_Iterable[_Union[Fabric, _Mapping]]] = ..., running_shards: _Optional[_Iterable[_Union[RunningShard, _Mapping]]] = ..., certificate_not_after: _Optional[int] = ..., stray_processes: _Optional[_Iterable[_Union[StrayProcess, _Mapping]]] = ..., advertise_address: _Optional[str] = ..., cached_models: _Optional[_Iterable[_Union[CachedModel, _Mapping]]] = ..., peer_address: _Optional[str] = ..., cache_capacity: _Optional[int] = ..., cache_free: _Optional[int] = ...) -> None: ...

class CachedModel(_message.Message):
    __slots__ = ("key", "source", "size", "state", "last_used", "revision")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    key: str
    source: str
    size: int
    state: str
    last_used: float
    revision: str
    def __init__(self, key: _Optional[str] = ..., source: _Optional[str] = ..., size: _Optional[int] = ..., state: _Optional[str] = ..., last_used: _Optional[float] = ..., revision: _Optional[str] = ...) -> None: ...

class StrayProcess(_message.Message):
    __slots__ = ("pid", "pgid", "shard_id", "reason", "command")
    PID_FIELD_NUMBER: _ClassVar[int]
    PGID_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    pid: int
    pgid: int
    shard_id: str
    reason: str
    command: str
    def __init__(self, pid: _Optional[int] = ..., pgid: _Optional[int] = ..., shard_id: _Optional[str] = ..., reason: _Optional[str] = ..., command: _Optional[str] = ...) -> None: ...

class GPU(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_total_mb", "memory_used_mb", "problems")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_MB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_MB_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_total_mb: int
    memory_used_mb: int
    problems: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_total_mb: _Optional[int] = ..., memory_used_mb: _Optional[int] = ..., problems: _Optional[_Iterable[str]] = ...) -> None: ...

class Fabric(_message.Message):
    __slots__ = ("name", "address")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class RunningShard(_message.Message):
    __slots__ = ("shard_id", "replica_id", "model", "profile", "rank", "gpu_indices", "port", "state", "world_size", "epoch", "pgid", "record_lost")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GPU_INDICES_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PGID_FIELD_NUMBER: _ClassVar[int]
    RECORD_LOST_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    replica_id: str
    model: str
    profile: str
    rank: int
    gpu_indices: _containers.RepeatedScalarFieldContainer[int]
    port: int
    state: ShardStatus.State
    world_size: int
    epoch: int
    pgid: int
    record_lost: bool
    def __init__(self, shard_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., model: _Optional[str] = ..., profile: _Optional[str] = ..., rank: _Optional[int] = ..., gpu_indices: _Optional[_Iterable[int]] = ..., port: _Optional[int] = ..., state: _Optional[_Union[ShardStatus.State, str]] = ..., world_size: _Optional[int] = ..., epoch: _Optional[int] = ..., pgid: _Optional[int] = ..., record_lost: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("gpu_memory_used_mb", "new_problems", "new_gpu_problems", "shard_signals", "fetches", "cached_models", "cache_changed", "cache_capacity", "cache_free")
    GPU_MEMORY_USED_MB_FIELD_NUMBER: _ClassVar[int]
    NEW_PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    NEW_GPU_PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    SHARD_SIGNALS_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    CACHED_MODELS_FIELD_NUMBER: _ClassVar[int]
    CACHE_CHANGED_FIELD_NUMBER: _ClassVar[int]
    CACHE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_FREE_FIELD_NUMBER: _ClassVar[int]
    gpu_memory_used_mb: _containers.RepeatedScalarFieldContainer[int]
    new_problems: _containers.RepeatedScalarFieldContainer[str]
    new_gpu_problems: _containers.RepeatedCompositeFieldContainer[GPUProblem]
    shard_signals: _containers.RepeatedCompositeFieldContainer[ShardSignals]
    fetches: _containers.RepeatedCompositeFieldContainer[FetchProgress]
    cached_models: _containers.RepeatedCompositeFieldContainer[CachedModel]
    cache_changed: bool
    cache_capacity: int
    cache_free: int
    def __init__(self, gpu_memory_used_mb: _Optional[_Iterable[int]] = ..., new_problems: _Optional[_Iterable[str]] = ..., new_gpu_problems: _Optional[_Iterable[_Union[GPUProblem, _Mapping]]] = ..., shard_signals: _Optional[_Iterable[_Union[ShardSignals, _Mapping]]] = ..., fetches: _Optional[_Iterable[_Union[FetchProgress, _Mapping]]] = ..., cached_models: _Optional[_Iterable[_Union[CachedModel, _Mapping]]] = ..., cache_changed: _Optional[bool] = ..., cache_capacity: _Optional[int] = ..., cache_free: _Optional[int] = ...) -> None: ...

class FetchProgress(_message.Message):
    __slots__ = ("shard_id", "done", "total", "rate")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    done: int
    total: int
    rate: float
    def __init__(self, shard_id: _Optional[str] = ..., done: _Optional[int] = ..., total: _Optional[int] = ..., rate: _Optional[float] = ...) -> None: ...

class ShardSignals(_message.Message):
    __slots__ = ("shard_id", "waiting", "running", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "age_s", "error", "generated_tokens", "flat_for_s", "adapters", "sleeping", "wake_path", "sleep_refused")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FLAT_FOR_S_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    WAKE_PATH_FIELD_NUMBER: _ClassVar[int]
    SLEEP_REFUSED_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    waiting: float
    running: float
    kv_cache_usage: float
    prefix_cache_queries: float
    prefix_cache_hits: float
    age_s: float
    error: str
    generated_tokens: float
    flat_for_s: float
    adapters: _containers.RepeatedScalarFieldContainer[str]
    sleeping: bool
    wake_path: str
    sleep_refused: str
    def __init__(self, shard_id: _Optional[str] = ..., waiting: _Optional[float] = ..., running: _Optional[float] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[float] = ..., prefix_cache_hits: _Optional[float] = ..., age_s: _Optional[float] = ..., error: _Optional[str] = ..., generated_tokens: _Optional[float] = ..., flat_for_s: _Optional[float] = ..., adapters: _Optional[_Iterable[str]] = ..., sleeping: _Optional[bool] = ..., wake_path: _Optional[str] = ..., sleep_refused: _Optional[str] = ...) -> None: ...

class GPUProblem(_message.Message):
    __slots__ = ("gpu_index", "problem")
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    gpu_index: int
    problem: str
    def __init__(self, gpu_index: _Optional[int] = ..., problem: _Optional[str] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("replica_id", "shard_id", "state", "error", "exit_code", "last_output", "signal", "crash_class")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[ShardStatus.State]
        STATE_STARTING: _ClassVar[ShardStatus.State]
        STATE_READY: _ClassVar[ShardStatus.State]
        STATE_DRAINING: _ClassVar[ShardStatus.State]
        STATE_STOPPED: _ClassVar[ShardStatus.State]
        STATE_FAILED: _ClassVar[ShardStatus.State]
        STATE_STOPPING: _ClassVar[ShardStatus.State]
        STATE_FETCHING: _ClassVar[ShardStatus.State]
    STATE_UNSPECIFIED: ShardStatus.State
    STATE_STARTING: ShardStatus.State
    STATE_READY: ShardStatus.State
    STATE_DRAINING: ShardStatus.State
    STATE_STOPPED: ShardStatus.State
    STATE_FAILED: ShardStatus.State
    STATE_STOPPING: ShardStatus.State
    STATE_FETCHING: ShardStatus.State
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    LAST_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    CRASH_CLASS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    shard_id: str
    state: ShardStatus.State
    error: str
    exit_code: int
    last_output: str
    signal: int
    crash_class: str
    def __init__(self, replica_id: _Optional[str] = ..., shard_id: _Optional[str] = ..., state: _Optional[_Union[ShardStatus.State, str]] = ..., error: _Optional[str] = ..., exit_code: _Optional[int] = ..., last_output: _Optional[str] = ..., signal: _Optional[int] = ..., crash_class: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("message_id", "ok", "code", "error")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CODE_UNSPECIFIED: _ClassVar[Ack.Code]
        CODE_INVALID_ARGUMENT: _ClassVar[Ack.Code]
        CODE_UNAUTHENTICATED: _ClassVar[Ack.Code]
        CODE_PERMISSION_DENIED: _ClassVar[Ack.Code]
        CODE_FAILED_PRECONDITION: _ClassVar[Ack.Code]
        CODE_RESOURCE_EXHAUSTED: _ClassVar[Ack.Code]
    CODE_UNSPECIFIED: Ack.Code
    CODE_INVALID_ARGUMENT: Ack.Code
    CODE_UNAUTHENTICATED: Ack.Code
    CODE_PERMISSION_DENIED: Ack.Code
    CODE_FAILED_PRECONDITION: Ack.Code
    CODE_RESOURCE_EXHAUSTED: Ack.Code
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    ok: bool
    code: Ack.Code
    error: str
    def __init__(self, message_id: _Optional[str] = ..., ok: _Optional[bool] = ..., code: _Optional[_Union[Ack.Code, str]] = ..., error: _Optional[str] = ...) -> None: ...

class StartShard(_message.Message):
    __slots__ = ("shard_id", "replica_id", "model", "profile", "rank", "world_size", "leader_address", "argv", "env", "gpu_indices", "port", "health_path", "startup_timeout_s", "stop_grace_s", "epoch", "drain_timeout_s", "engine", "metrics_path", "metric_names", "stop_signal", "ready_while_alive", "source", "model_peers", "stall_after_s", "adapters", "sleep_level", "sleep_after_s")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class MetricNamesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    GPU_INDICES_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    HEALTH_PATH_FIELD_NUMBER: _ClassVar[int]
    STARTUP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STOP_GRACE_S_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    METRICS_PATH_FIELD_NUMBER: _ClassVar[int]
    METRIC_NAMES_FIELD_NUMBER: _ClassVar[int]
    STOP_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    READY_WHILE_ALIVE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PEERS_FIELD_NUMBER: _ClassVar[int]
    STALL_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    SLEEP_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    replica_id: str
    model: str
    profile: str
    rank: int
    world_size: int
    leader_address: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    gpu_indices: _containers.RepeatedScalarFieldContainer[int]
    port: int
    health_path: str
    startup_timeout_s: int
    stop_grace_s: int
    epoch: int
    drain_timeout_s: int
    engine: str
    metrics_path: str
    metric_names: _containers.ScalarMap[str, str]
    stop_signal: str
    ready_while_alive: bool
    source: ModelSource
    model_peers: _containers.RepeatedScalarFieldContainer[str]
    stall_after_s: float
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterSource]
    sleep_level: int
    sleep_after_s: float
    def __init__(self, shard_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., model: _Optional[str] = ..., profile: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., leader_address: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., gpu_indices: _Optional[_Iterable[int]] = ..., port: _Optional[int] = ..., health_path: _Optional[str] = ..., startup_timeout_s: _Optional[int] = ..., stop_grace_s: _Optional[int] = ..., epoch: _Optional[int] = ..., drain_timeout_s: _Optional[int] = ..., engine: _Optional[str] = ..., metrics_path: _Optional[str] = ..., metric_names: _Optional[_Mapping[str, str]] = ..., stop_signal: _Optional[str] = ..., ready_while_alive: _Optional[bool] = ..., source: _Optional[_Union[ModelSource, _Mapping]] = ..., model_peers: _Optional[_Iterable[str]] = ..., stall_after_s: _Optional[float] = ..., adapters: _Optional[_Iterable[_Union[AdapterSource, _Mapping]]] = ..., sleep_level: _Optional[int] = ..., sleep_after_s: _Optional[float] = ...) -> None: ...

class AdapterSource(_message.Message):
    __slots__ = ("name", "source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: ModelSource
    def __init__(self, name: _Optional[str] = ..., source: _Optional[_Union[ModelSource, _Mapping]] = ...) -> None: ...

class PrefetchModel(_message.Message):
    __slots__ = ("message_id", "source", "model_peers", "pin", "epoch")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PEERS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    source: ModelSource
    model_peers: _containers.RepeatedScalarFieldContainer[str]
    pin: str
    epoch: int
    def __init__(self, message_id: _Optional[str] = ..., source: _Optional[_Union[ModelSource, _Mapping]] = ..., model_peers: _Optional[_Iterable[str]] = ..., pin: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class DropModel(_message.Message):
    __slots__ = ("message_id", "key", "pin", "epoch")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    key: str
    pin: str
    epoch: int
    def __init__(self, message_id: _Optional[str] = ..., key: _Optional[str] = ..., pin: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class ModelSource(_message.Message):
    __slots__ = ("scheme", "repo", "revision", "file", "url", "sha256", "path")
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    REPO_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    scheme: str
    repo: str
    revision: str
    file: str
    url: str
    sha256: str
    path: str
    def __init__(self, scheme: _Optional[str] = ..., repo: _Optional[str] = ..., revision: _Optional[str] = ..., file: _Optional[str] = ..., url: _Optional[str] = ..., sha256: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadAdapter(_message.Message):
    __slots__ = ("message_id", "shard_id", "name", "source", "epoch")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    shard_id: str
    name: str
    source: ModelSource
    epoch: int
    def __init__(self, message_id: _Optional[str] = ..., shard_id: _Optional[str] = ..., name: _Optional[str] = ..., source: _Optional[_Union[ModelSource, _Mapping]] = ..., epoch: _Optional[int] = ...) -> None: ...

class StopShard(_message.Message):
    __slots__ = ("shard_id", "epoch")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    epoch: int
    def __init__(self, shard_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class DrainShard(_message.Message):
    __slots__ = ("shard_id", "epoch")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    epoch: int
    def __init__(self, shard_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class SleepShard(_message.Message):
    __slots__ = ("shard_id", "epoch")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    epoch: int
    def __init__(self, shard_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class CertificateRequest(_message.Message):
    __slots__ = ("csr_pem",)
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    csr_pem: bytes
    def __init__(self, csr_pem: _Optional[bytes] = ...) -> None: ...

class CertificateIssued(_message.Message):
    __slots__ = ("certificate_pem", "ca_bundle_pem")
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    CA_BUNDLE_PEM_FIELD_NUMBER: _ClassVar[int]
    certificate_pem: bytes
    ca_bundle_pem: bytes
    def __init__(self, certificate_pem: _Optional[bytes] = ..., ca_bundle_pem: _Optional[bytes] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("token_id", "token_secret", "node_id", "csr_pem")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SECRET_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    token_id: str
    token_secret: str
    node_id: str
    csr_pem: bytes
    def __init__(self, token_id: _Optional[str] = ..., token_secret: _Optional[str] = ..., node_id: _Optional[str] = ..., csr_pem: _Optional[bytes] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("status", "error", "issued", "agent_port")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[JoinResponse.Status]
        STATUS_ISSUED: _ClassVar[JoinResponse.Status]
        STATUS_PENDING: _ClassVar[JoinResponse.Status]
        STATUS_REFUSED: _ClassVar[JoinResponse.Status]
    STATUS_UNSPECIFIED: JoinResponse.Status
    STATUS_ISSUED: JoinResponse.Status
    STATUS_PENDING: JoinResponse.Status
    STATUS_REFUSED: JoinResponse.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ISSUED_FIELD_NUMBER: _ClassVar[int]
    AGENT_PORT_FIELD_NUMBER: _ClassVar[int]
    status: JoinResponse.Status
    error: str
    issued: CertificateIssued
    agent_port: int
    def __init__(self, status: _Optional[_Union[JoinResponse.Status, str]] = ..., error: _Optional[str] = ..., issued: _Optional[_Union[CertificateIssued, _Mapping]] = ..., agent_port: _Optional[int] = ...) -> None: ...
