from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandleKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANDLE_KIND_UNSPECIFIED: _ClassVar[HandleKind]
    HANDLE_KIND_SHM: _ClassVar[HandleKind]
    HANDLE_KIND_FD: _ClassVar[HandleKind]
    HANDLE_KIND_CUMEM: _ClassVar[HandleKind]
    HANDLE_KIND_CUMEM_FABRIC: _ClassVar[HandleKind]

class GpuRoute(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GPU_ROUTE_UNSPECIFIED: _ClassVar[GpuRoute]
    GPU_ROUTE_CUMEM_IMPORT: _ClassVar[GpuRoute]
    GPU_ROUTE_REGISTER_READ_ONLY: _ClassVar[GpuRoute]
    GPU_ROUTE_HOST_PAGE_TABLES: _ClassVar[GpuRoute]
    GPU_ROUTE_REGISTER_WRITABLE: _ClassVar[GpuRoute]
HANDLE_KIND_UNSPECIFIED: HandleKind
HANDLE_KIND_SHM: HandleKind
HANDLE_KIND_FD: HandleKind
HANDLE_KIND_CUMEM: HandleKind
HANDLE_KIND_CUMEM_FABRIC: HandleKind
GPU_ROUTE_UNSPECIFIED: GpuRoute
GPU_ROUTE_CUMEM_IMPORT: GpuRoute
GPU_ROUTE_REGISTER_READ_ONLY: GpuRoute
GPU_ROUTE_HOST_PAGE_TABLES: GpuRoute
GPU_ROUTE_REGISTER_WRITABLE: GpuRoute

class AttachRequest(_message.Message):
    __slots__ = ("set_id", "checkpoint", "tensors", "pid", "labels", "accept", "reattach", "nonce", "pid_namespace", "pid_start", "numa_node", "device", "gpu_route")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SET_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_FIELD_NUMBER: _ClassVar[int]
    REATTACH_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PID_START_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_ROUTE_FIELD_NUMBER: _ClassVar[int]
    set_id: str
    checkpoint: str
    tensors: str
    pid: int
    labels: _containers.ScalarMap[str, str]
    accept: _containers.RepeatedScalarFieldContainer[HandleKind]
    reattach: bool
    nonce: str
    pid_namespace: int
    pid_start: int
    numa_node: int
    device: str
    gpu_route: GpuRoute
    def __init__(self, set_id: _Optional[str] = ..., checkpoint: _Optional[str] = ..., tensors: _Optional[str] = ..., pid: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., accept: _Optional[_Iterable[_Union[HandleKind, str]]] = ..., reattach: _Optional[bool] = ..., nonce: _Optional[str] = ..., pid_namespace: _Optional[int] = ..., pid_start: _Optional[int] = ..., numa_node: _Optional[int] = ..., device: _Optional[str] = ..., gpu_route: _Optional[_Union[GpuRoute, str]] = ...) -> None: ...

class AttachEvent(_message.Message):
    __slots__ = ("progress", "attached", "draining", "stale")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    progress: LoadProgress
    attached: Attachment
    draining: Draining
    stale: Stale
    def __init__(self, progress: _Optional[_Union[LoadProgress, _Mapping]] = ..., attached: _Optional[_Union[Attachment, _Mapping]] = ..., draining: _Optional[_Union[Draining, _Mapping]] = ..., stale: _Optional[_Union[Stale, _Mapping]] = ...) -> None: ...

class LoadProgress(_message.Message):
    __slots__ = ("bytes_done", "bytes_total")
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    bytes_done: int
    bytes_total: int
    def __init__(self, bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ...) -> None: ...

class Draining(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Stale(_message.Message):
    __slots__ = ("reason", "tensors", "next_set_id", "next_generation")
    REASON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NEXT_SET_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    reason: str
    tensors: _containers.RepeatedScalarFieldContainer[str]
    next_set_id: str
    next_generation: int
    def __init__(self, reason: _Optional[str] = ..., tensors: _Optional[_Iterable[str]] = ..., next_set_id: _Optional[str] = ..., next_generation: _Optional[int] = ...) -> None: ...

class Attachment(_message.Message):
    __slots__ = ("set_id", "fingerprint", "nonce", "lease_id", "tensors", "sources", "fd_channel", "gpu_route")
    SET_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    FD_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    GPU_ROUTE_FIELD_NUMBER: _ClassVar[int]
    set_id: str
    fingerprint: str
    nonce: str
    lease_id: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorHandle]
    sources: _containers.RepeatedCompositeFieldContainer[SourceFile]
    fd_channel: FdChannel
    gpu_route: GpuRoute
    def __init__(self, set_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., nonce: _Optional[str] = ..., lease_id: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorHandle, _Mapping]]] = ..., sources: _Optional[_Iterable[_Union[SourceFile, _Mapping]]] = ..., fd_channel: _Optional[_Union[FdChannel, _Mapping]] = ..., gpu_route: _Optional[_Union[GpuRoute, str]] = ...) -> None: ...

class FdChannel(_message.Message):
    __slots__ = ("socket", "secret")
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    socket: str
    secret: str
    def __init__(self, socket: _Optional[str] = ..., secret: _Optional[str] = ...) -> None: ...

class FdRequest(_message.Message):
    __slots__ = ("lease_id", "secret")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    secret: str
    def __init__(self, lease_id: _Optional[str] = ..., secret: _Optional[str] = ...) -> None: ...

class FdReply(_message.Message):
    __slots__ = ("error", "files", "more", "reason")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    error: str
    files: _containers.RepeatedScalarFieldContainer[str]
    more: bool
    reason: str
    def __init__(self, error: _Optional[str] = ..., files: _Optional[_Iterable[str]] = ..., more: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class SourceFile(_message.Message):
    __slots__ = ("path", "dev", "ino", "size", "mtime_ns", "ctime_ns")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DEV_FIELD_NUMBER: _ClassVar[int]
    INO_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MTIME_NS_FIELD_NUMBER: _ClassVar[int]
    CTIME_NS_FIELD_NUMBER: _ClassVar[int]
    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    def __init__(self, path: _Optional[str] = ..., dev: _Optional[int] = ..., ino: _Optional[int] = ..., size: _Optional[int] = ..., mtime_ns: _Optional[int] = ..., ctime_ns: _Optional[int] = ...) -> None: ...

class TensorHandle(_message.Message):
    __slots__ = ("name", "dtype", "shape", "kind", "shm", "fd", "cumem", "parts", "part_rows")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    CUMEM_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    PART_ROWS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    kind: HandleKind
    shm: ShmHandle
    fd: FdHandle
    cumem: CuMemHandle
    parts: _containers.RepeatedScalarFieldContainer[str]
    part_rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., kind: _Optional[_Union[HandleKind, str]] = ..., shm: _Optional[_Union[ShmHandle, _Mapping]] = ..., fd: _Optional[_Union[FdHandle, _Mapping]] = ..., cumem: _Optional[_Union[CuMemHandle, _Mapping]] = ..., parts: _Optional[_Iterable[str]] = ..., part_rows: _Optional[_Iterable[int]] = ...) -> None: ...

class CuMemHandle(_message.Message):
    __slots__ = ("file", "fabric", "size", "offset", "length", "host_numa", "device_uuid")
    FILE_FIELD_NUMBER: _ClassVar[int]
    FABRIC_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    HOST_NUMA_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    file: str
    fabric: bytes
    size: int
    offset: int
    length: int
    host_numa: int
    device_uuid: str
    def __init__(self, file: _Optional[str] = ..., fabric: _Optional[bytes] = ..., size: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., host_numa: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class FdHandle(_message.Message):
    __slots__ = ("file", "offset", "length")
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    file: str
    offset: int
    length: int
    def __init__(self, file: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ShmHandle(_message.Message):
    __slots__ = ("path", "offset", "length", "set_dir")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SET_DIR_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    length: int
    set_dir: str
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., set_dir: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("daemon", "shm", "sets", "backings", "fallbacks")
    DAEMON_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    SETS_FIELD_NUMBER: _ClassVar[int]
    BACKINGS_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    daemon: DaemonInfo
    shm: ShmInfo
    sets: _containers.RepeatedCompositeFieldContainer[SetInfo]
    backings: _containers.RepeatedCompositeFieldContainer[BackingInfo]
    fallbacks: _containers.RepeatedCompositeFieldContainer[FallbackInfo]
    def __init__(self, daemon: _Optional[_Union[DaemonInfo, _Mapping]] = ..., shm: _Optional[_Union[ShmInfo, _Mapping]] = ..., sets: _Optional[_Iterable[_Union[SetInfo, _Mapping]]] = ..., backings: _Optional[_Iterable[_Union[BackingInfo, _Mapping]]] = ..., fallbacks: _Optional[_Iterable[_Union[FallbackInfo, _Mapping]]] = ...) -> None: ...

class FallbackInfo(_message.Message):
    __slots__ = ("pid", "uid", "pid_verified", "set_id", "checkpoint", "cause", "reason", "bytes", "since_s", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    PID_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    SET_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SINCE_S_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    uid: int
    pid_verified: bool
    set_id: str
    checkpoint: str
    cause: str
    reason: str
    bytes: int
    since_s: float
    labels: _containers.ScalarMap[str, str]
    def __init__(self, pid: _Optional[int] = ..., uid: _Optional[int] = ..., pid_verified: _Optional[bool] = ..., set_id: _Optional[str] = ..., checkpoint: _Optional[str] = ..., cause: _Optional[str] = ..., reason: _Optional[str] = ..., bytes: _Optional[int] = ..., since_s: _Optional[float] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DaemonInfo(_message.Message):
    __slots__ = ("version", "pid", "uptime_s", "socket", "ready", "writable_gpu_mappings", "worker_share_per_uid", "worker_set_grace_s", "failed_checkpoints")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    WRITABLE_GPU_MAPPINGS_FIELD_NUMBER: _ClassVar[int]
    WORKER_SHARE_PER_UID_FIELD_NUMBER: _ClassVar[int]
    WORKER_SET_GRACE_S_FIELD_NUMBER: _ClassVar[int]
    FAILED_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    version: str
    pid: int
    uptime_s: float
    socket: str
    ready: bool
    writable_gpu_mappings: bool
    worker_share_per_uid: float
    worker_set_grace_s: float
    failed_checkpoints: _containers.RepeatedCompositeFieldContainer[FailedCheckpoint]
    def __init__(self, version: _Optional[str] = ..., pid: _Optional[int] = ..., uptime_s: _Optional[float] = ..., socket: _Optional[str] = ..., ready: _Optional[bool] = ..., writable_gpu_mappings: _Optional[bool] = ..., worker_share_per_uid: _Optional[float] = ..., worker_set_grace_s: _Optional[float] = ..., failed_checkpoints: _Optional[_Iterable[_Union[FailedCheckpoint, _Mapping]]] = ...) -> None: ...

class FailedCheckpoint(_message.Message):
    __slots__ = ("checkpoint", "error")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    checkpoint: str
    error: str
    def __init__(self, checkpoint: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class ShmInfo(_message.Message):
    __slots__ = ("dir", "total_bytes", "used_bytes", "free_bytes", "huge_pages", "page_size")
    DIR_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HUGE_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    dir: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    huge_pages: bool
    page_size: int
    def __init__(self, dir: _Optional[str] = ..., total_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., huge_pages: _Optional[bool] = ..., page_size: _Optional[int] = ...) -> None: ...

class BackingInfo(_message.Message):
    __slots__ = ("name", "where", "total_bytes", "used_bytes", "free_bytes", "page_size", "survives_restart", "stands_in_for", "reason", "small_pages_reason", "small_pages_fix")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SURVIVES_RESTART_FIELD_NUMBER: _ClassVar[int]
    STANDS_IN_FOR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SMALL_PAGES_REASON_FIELD_NUMBER: _ClassVar[int]
    SMALL_PAGES_FIX_FIELD_NUMBER: _ClassVar[int]
    name: str
    where: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    page_size: int
    survives_restart: bool
    stands_in_for: str
    reason: str
    small_pages_reason: str
    small_pages_fix: str
    def __init__(self, name: _Optional[str] = ..., where: _Optional[str] = ..., total_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., page_size: _Optional[int] = ..., survives_restart: _Optional[bool] = ..., stands_in_for: _Optional[str] = ..., reason: _Optional[str] = ..., small_pages_reason: _Optional[str] = ..., small_pages_fix: _Optional[str] = ...) -> None: ...

class SetInfo(_message.Message):
    __slots__ = ("set_id", "checkpoint", "fingerprint", "bytes", "backing", "state", "bytes_loaded", "adopted", "locked", "error", "leases", "tensors", "load_seconds", "lease_count", "page_size", "bytes_per_node", "numa_node", "huge_page_bytes", "family", "source", "changed_tensors", "resident_bytes", "bytes_by_source", "published", "page_cache_warming", "unconfigured", "generation", "replaced_by")
    class BytesPerNodeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class BytesBySourceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SET_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKING_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    LOCKED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_COUNT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    HUGE_PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CHANGED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_BY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    PAGE_CACHE_WARMING_FIELD_NUMBER: _ClassVar[int]
    UNCONFIGURED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REPLACED_BY_FIELD_NUMBER: _ClassVar[int]
    set_id: str
    checkpoint: str
    fingerprint: str
    bytes: int
    backing: str
    state: str
    bytes_loaded: int
    adopted: bool
    locked: bool
    error: str
    leases: _containers.RepeatedCompositeFieldContainer[LeaseInfo]
    tensors: int
    load_seconds: float
    lease_count: int
    page_size: int
    bytes_per_node: _containers.ScalarMap[int, int]
    numa_node: int
    huge_page_bytes: int
    family: str
    source: str
    changed_tensors: _containers.RepeatedScalarFieldContainer[str]
    resident_bytes: int
    bytes_by_source: _containers.ScalarMap[str, int]
    published: bool
    page_cache_warming: str
    unconfigured: bool
    generation: int
    replaced_by: str
    def __init__(self, set_id: _Optional[str] = ..., checkpoint: _Optional[str] = ..., fingerprint: _Optional[str] = ..., bytes: _Optional[int] = ..., backing: _Optional[str] = ..., state: _Optional[str] = ..., bytes_loaded: _Optional[int] = ..., adopted: _Optional[bool] = ..., locked: _Optional[bool] = ..., error: _Optional[str] = ..., leases: _Optional[_Iterable[_Union[LeaseInfo, _Mapping]]] = ..., tensors: _Optional[int] = ..., load_seconds: _Optional[float] = ..., lease_count: _Optional[int] = ..., page_size: _Optional[int] = ..., bytes_per_node: _Optional[_Mapping[int, int]] = ..., numa_node: _Optional[int] = ..., huge_page_bytes: _Optional[int] = ..., family: _Optional[str] = ..., source: _Optional[str] = ..., changed_tensors: _Optional[_Iterable[str]] = ..., resident_bytes: _Optional[int] = ..., bytes_by_source: _Optional[_Mapping[str, int]] = ..., published: _Optional[bool] = ..., page_cache_warming: _Optional[str] = ..., unconfigured: _Optional[bool] = ..., generation: _Optional[int] = ..., replaced_by: _Optional[str] = ...) -> None: ...

class LeaseInfo(_message.Message):
    __slots__ = ("lease_id", "pid", "labels", "attached_s", "stale", "pid_verified", "kind", "device", "gpu_route", "uid")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_S_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    PID_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_ROUTE_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    pid: int
    labels: _containers.ScalarMap[str, str]
    attached_s: float
    stale: bool
    pid_verified: bool
    kind: HandleKind
    device: str
    gpu_route: GpuRoute
    uid: int
    def __init__(self, lease_id: _Optional[str] = ..., pid: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., attached_s: _Optional[float] = ..., stale: _Optional[bool] = ..., pid_verified: _Optional[bool] = ..., kind: _Optional[_Union[HandleKind, str]] = ..., device: _Optional[str] = ..., gpu_route: _Optional[_Union[GpuRoute, str]] = ..., uid: _Optional[int] = ...) -> None: ...

class FallbackReport(_message.Message):
    __slots__ = ("cause", "set_id", "pid", "bytes")
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    SET_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    cause: str
    set_id: str
    pid: int
    bytes: int
    def __init__(self, cause: _Optional[str] = ..., set_id: _Optional[str] = ..., pid: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class FallbackAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("checkpoint", "tensors", "replaces")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    REPLACES_FIELD_NUMBER: _ClassVar[int]
    checkpoint: str
    tensors: str
    replaces: str
    def __init__(self, checkpoint: _Optional[str] = ..., tensors: _Optional[str] = ..., replaces: _Optional[str] = ...) -> None: ...

class LoadEvent(_message.Message):
    __slots__ = ("progress", "ready")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    progress: LoadProgress
    ready: SetInfo
    def __init__(self, progress: _Optional[_Union[LoadProgress, _Mapping]] = ..., ready: _Optional[_Union[SetInfo, _Mapping]] = ...) -> None: ...

class DropRequest(_message.Message):
    __slots__ = ("set_id", "force")
    SET_ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    set_id: str
    force: bool
    def __init__(self, set_id: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DropReply(_message.Message):
    __slots__ = ("bytes", "leases")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    leases: int
    def __init__(self, bytes: _Optional[int] = ..., leases: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("set_id",)
    SET_ID_FIELD_NUMBER: _ClassVar[int]
    set_id: str
    def __init__(self, set_id: _Optional[str] = ...) -> None: ...

class VerifyReply(_message.Message):
    __slots__ = ("tensors", "bytes", "corrupted", "stale_leases", "fix")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CORRUPTED_FIELD_NUMBER: _ClassVar[int]
    STALE_LEASES_FIELD_NUMBER: _ClassVar[int]
    FIX_FIELD_NUMBER: _ClassVar[int]
    tensors: int
    bytes: int
    corrupted: _containers.RepeatedScalarFieldContainer[str]
    stale_leases: int
    fix: str
    def __init__(self, tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., corrupted: _Optional[_Iterable[str]] = ..., stale_leases: _Optional[int] = ..., fix: _Optional[str] = ...) -> None: ...
