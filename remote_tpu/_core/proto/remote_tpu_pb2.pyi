from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_PHASE_UNSPECIFIED: _ClassVar[JobPhase]
    JOB_PHASE_QUEUED: _ClassVar[JobPhase]
    JOB_PHASE_RUNNING: _ClassVar[JobPhase]
    JOB_PHASE_SUCCEEDED: _ClassVar[JobPhase]
    JOB_PHASE_FAILED: _ClassVar[JobPhase]
    JOB_PHASE_CANCELLED: _ClassVar[JobPhase]
    JOB_PHASE_TIMED_OUT: _ClassVar[JobPhase]
    JOB_PHASE_LOST: _ClassVar[JobPhase]
    JOB_PHASE_PREEMPTED: _ClassVar[JobPhase]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_GATEWAY: _ClassVar[Role]
    ROLE_PEER: _ClassVar[Role]

class StreamMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STREAM_MODE_UNSPECIFIED: _ClassVar[StreamMode]
    STREAM_MODE_LEADER: _ClassVar[StreamMode]
    STREAM_MODE_ALL: _ClassVar[StreamMode]
    STREAM_MODE_NONE: _ClassVar[StreamMode]

class FrameKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FRAME_KIND_UNSPECIFIED: _ClassVar[FrameKind]
    FRAME_KIND_CALL: _ClassVar[FrameKind]
    FRAME_KIND_CANCEL: _ClassVar[FrameKind]
    FRAME_KIND_EVENT: _ClassVar[FrameKind]
    FRAME_KIND_END: _ClassVar[FrameKind]
    FRAME_KIND_ERROR: _ClassVar[FrameKind]
    FRAME_KIND_REQUEST: _ClassVar[FrameKind]
    FRAME_KIND_HEALTH: _ClassVar[FrameKind]
    FRAME_KIND_HEALTH_REPLY: _ClassVar[FrameKind]
    FRAME_KIND_LINKED: _ClassVar[FrameKind]

class Control(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTROL_UNSPECIFIED: _ClassVar[Control]
    CONTROL_RELEASE: _ClassVar[Control]
    CONTROL_CANCEL: _ClassVar[Control]
    CONTROL_INTERRUPT: _ClassVar[Control]

class OutputStream(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_STREAM_UNSPECIFIED: _ClassVar[OutputStream]
    OUTPUT_STREAM_STDOUT: _ClassVar[OutputStream]
    OUTPUT_STREAM_STDERR: _ClassVar[OutputStream]

class HostState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HOST_STATE_UNSPECIFIED: _ClassVar[HostState]
    HOST_STATE_PENDING: _ClassVar[HostState]
    HOST_STATE_RUNNING: _ClassVar[HostState]
    HOST_STATE_SUCCEEDED: _ClassVar[HostState]
    HOST_STATE_FAILED: _ClassVar[HostState]
    HOST_STATE_DIED: _ClassVar[HostState]
    HOST_STATE_CANCELLED: _ClassVar[HostState]
    HOST_STATE_LOST: _ClassVar[HostState]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
    JOB_STATE_TIMED_OUT: _ClassVar[JobState]
    JOB_STATE_LOST: _ClassVar[JobState]
    JOB_STATE_PREEMPTED: _ClassVar[JobState]
JOB_PHASE_UNSPECIFIED: JobPhase
JOB_PHASE_QUEUED: JobPhase
JOB_PHASE_RUNNING: JobPhase
JOB_PHASE_SUCCEEDED: JobPhase
JOB_PHASE_FAILED: JobPhase
JOB_PHASE_CANCELLED: JobPhase
JOB_PHASE_TIMED_OUT: JobPhase
JOB_PHASE_LOST: JobPhase
JOB_PHASE_PREEMPTED: JobPhase
ROLE_UNSPECIFIED: Role
ROLE_GATEWAY: Role
ROLE_PEER: Role
STREAM_MODE_UNSPECIFIED: StreamMode
STREAM_MODE_LEADER: StreamMode
STREAM_MODE_ALL: StreamMode
STREAM_MODE_NONE: StreamMode
FRAME_KIND_UNSPECIFIED: FrameKind
FRAME_KIND_CALL: FrameKind
FRAME_KIND_CANCEL: FrameKind
FRAME_KIND_EVENT: FrameKind
FRAME_KIND_END: FrameKind
FRAME_KIND_ERROR: FrameKind
FRAME_KIND_REQUEST: FrameKind
FRAME_KIND_HEALTH: FrameKind
FRAME_KIND_HEALTH_REPLY: FrameKind
FRAME_KIND_LINKED: FrameKind
CONTROL_UNSPECIFIED: Control
CONTROL_RELEASE: Control
CONTROL_CANCEL: Control
CONTROL_INTERRUPT: Control
OUTPUT_STREAM_UNSPECIFIED: OutputStream
OUTPUT_STREAM_STDOUT: OutputStream
OUTPUT_STREAM_STDERR: OutputStream
HOST_STATE_UNSPECIFIED: HostState
HOST_STATE_PENDING: HostState
HOST_STATE_RUNNING: HostState
HOST_STATE_SUCCEEDED: HostState
HOST_STATE_FAILED: HostState
HOST_STATE_DIED: HostState
HOST_STATE_CANCELLED: HostState
HOST_STATE_LOST: HostState
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
JOB_STATE_TIMED_OUT: JobState
JOB_STATE_LOST: JobState
JOB_STATE_PREEMPTED: JobState

class LinkRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlobRef(_message.Message):
    __slots__ = ("digest", "size")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    digest: bytes
    size: int
    def __init__(self, digest: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class BlobQuery(_message.Message):
    __slots__ = ("blobs",)
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    blobs: _containers.RepeatedCompositeFieldContainer[BlobRef]
    def __init__(self, blobs: _Optional[_Iterable[_Union[BlobRef, _Mapping]]] = ...) -> None: ...

class BlobPresence(_message.Message):
    __slots__ = ("present", "capacity")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    capacity: int
    def __init__(self, present: _Optional[_Iterable[bool]] = ..., capacity: _Optional[int] = ...) -> None: ...

class BlobChunk(_message.Message):
    __slots__ = ("blob", "forward_to", "data", "to_slice")
    BLOB_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TO_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TO_SLICE_FIELD_NUMBER: _ClassVar[int]
    blob: BlobRef
    forward_to: _containers.RepeatedScalarFieldContainer[str]
    data: bytes
    to_slice: bool
    def __init__(self, blob: _Optional[_Union[BlobRef, _Mapping]] = ..., forward_to: _Optional[_Iterable[str]] = ..., data: _Optional[bytes] = ..., to_slice: _Optional[bool] = ...) -> None: ...

class BlobStored(_message.Message):
    __slots__ = ("refused", "onward_failed")
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    ONWARD_FAILED_FIELD_NUMBER: _ClassVar[int]
    refused: str
    onward_failed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, refused: _Optional[str] = ..., onward_failed: _Optional[_Iterable[str]] = ...) -> None: ...

class DataTicket(_message.Message):
    __slots__ = ("port", "nonce", "ticket", "refused")
    PORT_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    port: int
    nonce: bytes
    ticket: bytes
    refused: str
    def __init__(self, port: _Optional[int] = ..., nonce: _Optional[bytes] = ..., ticket: _Optional[bytes] = ..., refused: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("client_id",)
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    def __init__(self, client_id: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released", "detail")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    released: bool
    detail: str
    def __init__(self, released: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class DoctorRequest(_message.Message):
    __slots__ = ("hosts", "probe")
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedScalarFieldContainer[str]
    probe: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, hosts: _Optional[_Iterable[str]] = ..., probe: _Optional[_Iterable[str]] = ...) -> None: ...

class Probe(_message.Message):
    __slots__ = ("address", "error", "seconds", "host")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    address: str
    error: str
    seconds: float
    host: int
    def __init__(self, address: _Optional[str] = ..., error: _Optional[str] = ..., seconds: _Optional[float] = ..., host: _Optional[int] = ...) -> None: ...

class HostHealth(_message.Message):
    __slots__ = ("host", "address", "health", "error")
    HOST_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    host: int
    address: str
    health: HealthReply
    error: str
    def __init__(self, host: _Optional[int] = ..., address: _Optional[str] = ..., health: _Optional[_Union[HealthReply, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class DoctorReply(_message.Message):
    __slots__ = ("hosts", "probes")
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedCompositeFieldContainer[HostHealth]
    probes: _containers.RepeatedCompositeFieldContainer[Probe]
    def __init__(self, hosts: _Optional[_Iterable[_Union[HostHealth, _Mapping]]] = ..., probes: _Optional[_Iterable[_Union[Probe, _Mapping]]] = ...) -> None: ...

class JobRef(_message.Message):
    __slots__ = ("job_id", "data_port", "value_in_end", "interrupt")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    VALUE_IN_END_FIELD_NUMBER: _ClassVar[int]
    INTERRUPT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    data_port: bool
    value_in_end: bool
    interrupt: bool
    def __init__(self, job_id: _Optional[str] = ..., data_port: _Optional[bool] = ..., value_in_end: _Optional[bool] = ..., interrupt: _Optional[bool] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "phase", "accelerator", "num_hosts", "created_at", "started_at", "ended_at", "detail", "queued_behind", "queue_position", "existed", "end", "warm_until", "attempts", "num_slices", "stalls", "metrics")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    NUM_HOSTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BEHIND_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    WARM_UNTIL_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLICES_FIELD_NUMBER: _ClassVar[int]
    STALLS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    phase: JobPhase
    accelerator: str
    num_hosts: int
    created_at: float
    started_at: float
    ended_at: float
    detail: str
    queued_behind: str
    queue_position: int
    existed: bool
    end: JobEnd
    warm_until: float
    attempts: _containers.RepeatedCompositeFieldContainer[Attempt]
    num_slices: int
    stalls: _containers.RepeatedCompositeFieldContainer[StallReport]
    metrics: _containers.RepeatedCompositeFieldContainer[HostMetrics]
    def __init__(self, job_id: _Optional[str] = ..., phase: _Optional[_Union[JobPhase, str]] = ..., accelerator: _Optional[str] = ..., num_hosts: _Optional[int] = ..., created_at: _Optional[float] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., detail: _Optional[str] = ..., queued_behind: _Optional[str] = ..., queue_position: _Optional[int] = ..., existed: _Optional[bool] = ..., end: _Optional[_Union[JobEnd, _Mapping]] = ..., warm_until: _Optional[float] = ..., attempts: _Optional[_Iterable[_Union[Attempt, _Mapping]]] = ..., num_slices: _Optional[int] = ..., stalls: _Optional[_Iterable[_Union[StallReport, _Mapping]]] = ..., metrics: _Optional[_Iterable[_Union[HostMetrics, _Mapping]]] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("cpu_seconds", "has_step", "step", "jax_ready", "busy", "rss_bytes", "tpu")
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HAS_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    JAX_READY_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    TPU_FIELD_NUMBER: _ClassVar[int]
    cpu_seconds: float
    has_step: bool
    step: int
    jax_ready: bool
    busy: bool
    rss_bytes: int
    tpu: TpuUsage
    def __init__(self, cpu_seconds: _Optional[float] = ..., has_step: _Optional[bool] = ..., step: _Optional[int] = ..., jax_ready: _Optional[bool] = ..., busy: _Optional[bool] = ..., rss_bytes: _Optional[int] = ..., tpu: _Optional[_Union[TpuUsage, _Mapping]] = ...) -> None: ...

class TpuUsage(_message.Message):
    __slots__ = ("duty_cycle_percent", "hbm_used_bytes", "hbm_total_bytes", "note")
    DUTY_CYCLE_PERCENT_FIELD_NUMBER: _ClassVar[int]
    HBM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HBM_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    duty_cycle_percent: float
    hbm_used_bytes: int
    hbm_total_bytes: int
    note: str
    def __init__(self, duty_cycle_percent: _Optional[float] = ..., hbm_used_bytes: _Optional[int] = ..., hbm_total_bytes: _Optional[int] = ..., note: _Optional[str] = ...) -> None: ...

class MetricsNow(_message.Message):
    __slots__ = ("hosts",)
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedCompositeFieldContainer[HostMetrics]
    def __init__(self, hosts: _Optional[_Iterable[_Union[HostMetrics, _Mapping]]] = ...) -> None: ...

class HostMetrics(_message.Message):
    __slots__ = ("host", "state", "has_step", "step", "steps_per_second", "cpu_percent", "rss_bytes", "output_bytes_per_second", "tpu", "updated_at")
    HOST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HAS_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TPU_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    host: int
    state: str
    has_step: bool
    step: int
    steps_per_second: float
    cpu_percent: float
    rss_bytes: int
    output_bytes_per_second: float
    tpu: TpuUsage
    updated_at: float
    def __init__(self, host: _Optional[int] = ..., state: _Optional[str] = ..., has_step: _Optional[bool] = ..., step: _Optional[int] = ..., steps_per_second: _Optional[float] = ..., cpu_percent: _Optional[float] = ..., rss_bytes: _Optional[int] = ..., output_bytes_per_second: _Optional[float] = ..., tpu: _Optional[_Union[TpuUsage, _Mapping]] = ..., updated_at: _Optional[float] = ...) -> None: ...

class StallReport(_message.Message):
    __slots__ = ("at", "quiet_seconds", "odd_hosts", "text", "cancelled")
    AT_FIELD_NUMBER: _ClassVar[int]
    QUIET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ODD_HOSTS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    at: float
    quiet_seconds: float
    odd_hosts: _containers.RepeatedScalarFieldContainer[int]
    text: str
    cancelled: bool
    def __init__(self, at: _Optional[float] = ..., quiet_seconds: _Optional[float] = ..., odd_hosts: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., cancelled: _Optional[bool] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("job_id", "hosts", "offsets", "follow", "merged", "since")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    MERGED_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    hosts: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    follow: bool
    merged: bool
    since: float
    def __init__(self, job_id: _Optional[str] = ..., hosts: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., follow: _Optional[bool] = ..., merged: _Optional[bool] = ..., since: _Optional[float] = ...) -> None: ...

class HostStacks(_message.Message):
    __slots__ = ("host", "text")
    HOST_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    host: int
    text: str
    def __init__(self, host: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class StacksReply(_message.Message):
    __slots__ = ("hosts",)
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedCompositeFieldContainer[HostStacks]
    def __init__(self, hosts: _Optional[_Iterable[_Union[HostStacks, _Mapping]]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListJobsReply(_message.Message):
    __slots__ = ("jobs", "omitted")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    OMITTED_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    omitted: int
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ..., omitted: _Optional[int] = ...) -> None: ...

class Versions(_message.Message):
    __slots__ = ("protocol", "remote_tpu", "python", "cloudpickle", "jax", "jaxlib", "libtpu")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TPU_FIELD_NUMBER: _ClassVar[int]
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    CLOUDPICKLE_FIELD_NUMBER: _ClassVar[int]
    JAX_FIELD_NUMBER: _ClassVar[int]
    JAXLIB_FIELD_NUMBER: _ClassVar[int]
    LIBTPU_FIELD_NUMBER: _ClassVar[int]
    protocol: int
    remote_tpu: str
    python: str
    cloudpickle: str
    jax: str
    jaxlib: str
    libtpu: str
    def __init__(self, protocol: _Optional[int] = ..., remote_tpu: _Optional[str] = ..., python: _Optional[str] = ..., cloudpickle: _Optional[str] = ..., jax: _Optional[str] = ..., jaxlib: _Optional[str] = ..., libtpu: _Optional[str] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("versions", "agent_address", "worker_id", "peers", "simulate_devices", "accelerator", "tpu_busy", "slice_source", "megascale_num_slices", "megascale_slice_id", "megascale_coordinator", "idle_delete", "idle_delete_problem")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SIMULATE_DEVICES_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    TPU_BUSY_FIELD_NUMBER: _ClassVar[int]
    SLICE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    MEGASCALE_NUM_SLICES_FIELD_NUMBER: _ClassVar[int]
    MEGASCALE_SLICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEGASCALE_COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    IDLE_DELETE_FIELD_NUMBER: _ClassVar[int]
    IDLE_DELETE_PROBLEM_FIELD_NUMBER: _ClassVar[int]
    versions: Versions
    agent_address: str
    worker_id: int
    peers: _containers.RepeatedScalarFieldContainer[str]
    simulate_devices: int
    accelerator: str
    tpu_busy: str
    slice_source: str
    megascale_num_slices: int
    megascale_slice_id: int
    megascale_coordinator: str
    idle_delete: str
    idle_delete_problem: str
    def __init__(self, versions: _Optional[_Union[Versions, _Mapping]] = ..., agent_address: _Optional[str] = ..., worker_id: _Optional[int] = ..., peers: _Optional[_Iterable[str]] = ..., simulate_devices: _Optional[int] = ..., accelerator: _Optional[str] = ..., tpu_busy: _Optional[str] = ..., slice_source: _Optional[str] = ..., megascale_num_slices: _Optional[int] = ..., megascale_slice_id: _Optional[int] = ..., megascale_coordinator: _Optional[str] = ..., idle_delete: _Optional[str] = ..., idle_delete_problem: _Optional[str] = ...) -> None: ...

class JaxTimeouts(_message.Message):
    __slots__ = ("initialization_seconds", "heartbeat_seconds", "shutdown_seconds")
    INITIALIZATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    initialization_seconds: int
    heartbeat_seconds: int
    shutdown_seconds: int
    def __init__(self, initialization_seconds: _Optional[int] = ..., heartbeat_seconds: _Optional[int] = ..., shutdown_seconds: _Optional[int] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("client_versions", "job_id", "accelerator", "num_hosts", "role", "hosts", "process_id", "coordinator_address", "stream", "env", "timeout_seconds", "jax_timeouts", "payload_size", "devices_per_host", "payload_digest", "processes_per_host", "keep_warm_seconds", "client_id", "payload", "skip_jax_init", "blobs", "working_dir", "output_dir", "collect_outputs", "data", "gcs_data", "requirements", "allow_jax_requirements", "num_slices", "retries", "attempt", "earlier_attempts", "keep_going", "profile_seconds", "result_over_data_port", "value_in_end", "offer_lane", "all_results", "compilation_cache", "stall_after_seconds", "cancel_on_stall")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CLIENT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    NUM_HOSTS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    JAX_TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_PER_HOST_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_PER_HOST_FIELD_NUMBER: _ClassVar[int]
    KEEP_WARM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SKIP_JAX_INIT_FIELD_NUMBER: _ClassVar[int]
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    COLLECT_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    GCS_DATA_FIELD_NUMBER: _ClassVar[int]
    REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_JAX_REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLICES_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    EARLIER_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    KEEP_GOING_FIELD_NUMBER: _ClassVar[int]
    PROFILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESULT_OVER_DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    VALUE_IN_END_FIELD_NUMBER: _ClassVar[int]
    OFFER_LANE_FIELD_NUMBER: _ClassVar[int]
    ALL_RESULTS_FIELD_NUMBER: _ClassVar[int]
    COMPILATION_CACHE_FIELD_NUMBER: _ClassVar[int]
    STALL_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_ON_STALL_FIELD_NUMBER: _ClassVar[int]
    client_versions: Versions
    job_id: str
    accelerator: str
    num_hosts: int
    role: Role
    hosts: _containers.RepeatedScalarFieldContainer[str]
    process_id: int
    coordinator_address: str
    stream: StreamMode
    env: _containers.ScalarMap[str, str]
    timeout_seconds: float
    jax_timeouts: JaxTimeouts
    payload_size: int
    devices_per_host: int
    payload_digest: bytes
    processes_per_host: int
    keep_warm_seconds: float
    client_id: str
    payload: bytes
    skip_jax_init: bool
    blobs: _containers.RepeatedCompositeFieldContainer[BlobRef]
    working_dir: WorkingDir
    output_dir: str
    collect_outputs: bool
    data: _containers.RepeatedCompositeFieldContainer[WorkingDir]
    gcs_data: _containers.RepeatedScalarFieldContainer[str]
    requirements: _containers.RepeatedScalarFieldContainer[str]
    allow_jax_requirements: bool
    num_slices: int
    retries: RetryPolicy
    attempt: int
    earlier_attempts: _containers.RepeatedCompositeFieldContainer[Attempt]
    keep_going: bool
    profile_seconds: float
    result_over_data_port: bool
    value_in_end: bool
    offer_lane: bool
    all_results: bool
    compilation_cache: str
    stall_after_seconds: float
    cancel_on_stall: bool
    def __init__(self, client_versions: _Optional[_Union[Versions, _Mapping]] = ..., job_id: _Optional[str] = ..., accelerator: _Optional[str] = ..., num_hosts: _Optional[int] = ..., role: _Optional[_Union[Role, str]] = ..., hosts: _Optional[_Iterable[str]] = ..., process_id: _Optional[int] = ..., coordinator_address: _Optional[str] = ..., stream: _Optional[_Union[StreamMode, str]] = ..., env: _Optional[_Mapping[str, str]] = ..., timeout_seconds: _Optional[float] = ..., jax_timeouts: _Optional[_Union[JaxTimeouts, _Mapping]] = ..., payload_size: _Optional[int] = ..., devices_per_host: _Optional[int] = ..., payload_digest: _Optional[bytes] = ..., processes_per_host: _Optional[int] = ..., keep_warm_seconds: _Optional[float] = ..., client_id: _Optional[str] = ..., payload: _Optional[bytes] = ..., skip_jax_init: _Optional[bool] = ..., blobs: _Optional[_Iterable[_Union[BlobRef, _Mapping]]] = ..., working_dir: _Optional[_Union[WorkingDir, _Mapping]] = ..., output_dir: _Optional[str] = ..., collect_outputs: _Optional[bool] = ..., data: _Optional[_Iterable[_Union[WorkingDir, _Mapping]]] = ..., gcs_data: _Optional[_Iterable[str]] = ..., requirements: _Optional[_Iterable[str]] = ..., allow_jax_requirements: _Optional[bool] = ..., num_slices: _Optional[int] = ..., retries: _Optional[_Union[RetryPolicy, _Mapping]] = ..., attempt: _Optional[int] = ..., earlier_attempts: _Optional[_Iterable[_Union[Attempt, _Mapping]]] = ..., keep_going: _Optional[bool] = ..., profile_seconds: _Optional[float] = ..., result_over_data_port: _Optional[bool] = ..., value_in_end: _Optional[bool] = ..., offer_lane: _Optional[bool] = ..., all_results: _Optional[bool] = ..., compilation_cache: _Optional[str] = ..., stall_after_seconds: _Optional[float] = ..., cancel_on_stall: _Optional[bool] = ...) -> None: ...

class RetryPolicy(_message.Message):
    __slots__ = ("preemptions", "failures", "backoff_seconds", "backoff_max_seconds")
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    preemptions: int
    failures: int
    backoff_seconds: float
    backoff_max_seconds: float
    def __init__(self, preemptions: _Optional[int] = ..., failures: _Optional[int] = ..., backoff_seconds: _Optional[float] = ..., backoff_max_seconds: _Optional[float] = ...) -> None: ...

class Attempt(_message.Message):
    __slots__ = ("number", "job_id", "state", "kind", "cause", "root_cause_host", "started_at", "ended_at")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    ROOT_CAUSE_HOST_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    number: int
    job_id: str
    state: JobState
    kind: str
    cause: str
    root_cause_host: int
    started_at: float
    ended_at: float
    def __init__(self, number: _Optional[int] = ..., job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., kind: _Optional[str] = ..., cause: _Optional[str] = ..., root_cause_host: _Optional[int] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ...) -> None: ...

class WorkingDir(_message.Message):
    __slots__ = ("files", "blobs", "digest")
    FILES_FIELD_NUMBER: _ClassVar[int]
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[WorkFile]
    blobs: _containers.RepeatedCompositeFieldContainer[BlobRef]
    digest: bytes
    def __init__(self, files: _Optional[_Iterable[_Union[WorkFile, _Mapping]]] = ..., blobs: _Optional[_Iterable[_Union[BlobRef, _Mapping]]] = ..., digest: _Optional[bytes] = ...) -> None: ...

class WorkFile(_message.Message):
    __slots__ = ("path", "size", "executable", "blob", "offset")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    EXECUTABLE_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    executable: bool
    blob: int
    offset: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., executable: _Optional[bool] = ..., blob: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("spec", "payload_chunk", "control", "next_call")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_CHUNK_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    NEXT_CALL_FIELD_NUMBER: _ClassVar[int]
    spec: JobSpec
    payload_chunk: bytes
    control: Control
    next_call: JobSpec
    def __init__(self, spec: _Optional[_Union[JobSpec, _Mapping]] = ..., payload_chunk: _Optional[bytes] = ..., control: _Optional[_Union[Control, str]] = ..., next_call: _Optional[_Union[JobSpec, _Mapping]] = ...) -> None: ...

class Output(_message.Message):
    __slots__ = ("stream", "data", "offset", "time")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    stream: OutputStream
    data: bytes
    offset: int
    time: float
    def __init__(self, stream: _Optional[_Union[OutputStream, str]] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ..., time: _Optional[float] = ...) -> None: ...

class RemoteException(_message.Message):
    __slots__ = ("type_name", "message", "traceback", "pickled")
    TYPE_NAME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    PICKLED_FIELD_NUMBER: _ClassVar[int]
    type_name: str
    message: str
    traceback: str
    pickled: bytes
    def __init__(self, type_name: _Optional[str] = ..., message: _Optional[str] = ..., traceback: _Optional[str] = ..., pickled: _Optional[bytes] = ...) -> None: ...

class HostReport(_message.Message):
    __slots__ = ("host", "state", "exit_code", "signal", "detail", "last_lines", "exception", "finished_at", "exited", "stacks", "preempted", "warm", "notices")
    HOST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    LAST_LINES_FIELD_NUMBER: _ClassVar[int]
    EXCEPTION_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    EXITED_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    NOTICES_FIELD_NUMBER: _ClassVar[int]
    host: int
    state: HostState
    exit_code: int
    signal: str
    detail: str
    last_lines: _containers.RepeatedScalarFieldContainer[str]
    exception: RemoteException
    finished_at: float
    exited: bool
    stacks: str
    preempted: bool
    warm: bool
    notices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, host: _Optional[int] = ..., state: _Optional[_Union[HostState, str]] = ..., exit_code: _Optional[int] = ..., signal: _Optional[str] = ..., detail: _Optional[str] = ..., last_lines: _Optional[_Iterable[str]] = ..., exception: _Optional[_Union[RemoteException, _Mapping]] = ..., finished_at: _Optional[float] = ..., exited: _Optional[bool] = ..., stacks: _Optional[str] = ..., preempted: _Optional[bool] = ..., warm: _Optional[bool] = ..., notices: _Optional[_Iterable[str]] = ...) -> None: ...

class JobEnd(_message.Message):
    __slots__ = ("state", "root_cause_host", "hosts", "detail", "result_digest", "notices", "permanent", "num_slices", "value", "lane", "warm_kept", "timeline")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROOT_CAUSE_HOST_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    RESULT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NOTICES_FIELD_NUMBER: _ClassVar[int]
    PERMANENT_FIELD_NUMBER: _ClassVar[int]
    NUM_SLICES_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    WARM_KEPT_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    root_cause_host: int
    hosts: _containers.RepeatedCompositeFieldContainer[HostReport]
    detail: str
    result_digest: bytes
    notices: _containers.RepeatedScalarFieldContainer[str]
    permanent: bool
    num_slices: int
    value: bytes
    lane: DataTicket
    warm_kept: bool
    timeline: _containers.RepeatedCompositeFieldContainer[HostTimes]
    def __init__(self, state: _Optional[_Union[JobState, str]] = ..., root_cause_host: _Optional[int] = ..., hosts: _Optional[_Iterable[_Union[HostReport, _Mapping]]] = ..., detail: _Optional[str] = ..., result_digest: _Optional[bytes] = ..., notices: _Optional[_Iterable[str]] = ..., permanent: _Optional[bool] = ..., num_slices: _Optional[int] = ..., value: _Optional[bytes] = ..., lane: _Optional[_Union[DataTicket, _Mapping]] = ..., warm_kept: _Optional[bool] = ..., timeline: _Optional[_Iterable[_Union[HostTimes, _Mapping]]] = ...) -> None: ...

class HostTimes(_message.Message):
    __slots__ = ("host", "worker_started_at", "jax_ready_at", "first_output_at", "ended_at")
    HOST_FIELD_NUMBER: _ClassVar[int]
    WORKER_STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    JAX_READY_AT_FIELD_NUMBER: _ClassVar[int]
    FIRST_OUTPUT_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    host: int
    worker_started_at: float
    jax_ready_at: float
    first_output_at: float
    ended_at: float
    def __init__(self, host: _Optional[int] = ..., worker_started_at: _Optional[float] = ..., jax_ready_at: _Optional[float] = ..., first_output_at: _Optional[float] = ..., ended_at: _Optional[float] = ...) -> None: ...

class Started(_message.Message):
    __slots__ = ("job_id", "pid", "coordinator_address")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    pid: int
    coordinator_address: str
    def __init__(self, job_id: _Optional[str] = ..., pid: _Optional[int] = ..., coordinator_address: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("host", "started", "output", "done", "exited", "result_chunk", "end", "queued", "result_size", "workers_started", "result_ticket", "lane", "progress", "stall", "metrics")
    HOST_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    EXITED_FIELD_NUMBER: _ClassVar[int]
    RESULT_CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RESULT_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_STARTED_FIELD_NUMBER: _ClassVar[int]
    RESULT_TICKET_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STALL_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    host: int
    started: Started
    output: Output
    done: HostReport
    exited: HostReport
    result_chunk: bytes
    end: JobEnd
    queued: JobStatus
    result_size: int
    workers_started: int
    result_ticket: DataTicket
    lane: DataTicket
    progress: Progress
    stall: StallReport
    metrics: MetricsNow
    def __init__(self, host: _Optional[int] = ..., started: _Optional[_Union[Started, _Mapping]] = ..., output: _Optional[_Union[Output, _Mapping]] = ..., done: _Optional[_Union[HostReport, _Mapping]] = ..., exited: _Optional[_Union[HostReport, _Mapping]] = ..., result_chunk: _Optional[bytes] = ..., end: _Optional[_Union[JobEnd, _Mapping]] = ..., queued: _Optional[_Union[JobStatus, _Mapping]] = ..., result_size: _Optional[int] = ..., workers_started: _Optional[int] = ..., result_ticket: _Optional[_Union[DataTicket, _Mapping]] = ..., lane: _Optional[_Union[DataTicket, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., stall: _Optional[_Union[StallReport, _Mapping]] = ..., metrics: _Optional[_Union[MetricsNow, _Mapping]] = ...) -> None: ...

class OutputsRequest(_message.Message):
    __slots__ = ("job_id", "this_host")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    THIS_HOST_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    this_host: bool
    def __init__(self, job_id: _Optional[str] = ..., this_host: _Optional[bool] = ...) -> None: ...

class OutputChunk(_message.Message):
    __slots__ = ("path", "size", "offset", "data", "error")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    offset: int
    data: bytes
    error: str
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., error: _Optional[str] = ...) -> None: ...
