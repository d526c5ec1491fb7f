"""The runtime preset: the software stack's memory outside the ledger's live tensors, as named, sourced data.

A runtime file (constraints/runtimes/*.toml) holds the sizes the memory items of `k3opt.memory_outside` are
built from: the CUDA context, NCCL's per-connection and per-channel buffers, NVLS buffers, the HybridEP
dispatcher's buffers, cuBLAS / TransformerEngine workspaces and the caching allocator's slack, plus the
environment knobs that change them (NCCL_NVLS_ENABLE, NCCL_BUFFSIZE, PYTORCH_CUDA_ALLOC_CONF). Every value is a
field a user can override with a measurement; the shipped preset names its source beside each value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import model_validator

from k3opt.specs import (
    MIB,
    NO_RUNTIME,
    ClusterSpec,
    Job,
    NonNegFloat,
    PosFloat,
    PosInt,
    StrictBool,
    _load,
    _Strict,
    load_cluster,
)

DEFAULT_RUNTIME = "megatron-te-hybridep-gb200"
"""The shipped runtime preset (load_runtime's default); a job's default is its cluster's `default_runtime`."""


class RuntimeSpec(_Strict):
    """Per-process sizes of one training stack on one GPU generation (bytes unless the name says otherwise)."""

    name: str
    description: str = ""
    # -- outside the caching allocator
    cuda_context_mib: PosFloat
    """CUDA context and lazily loaded kernel images of one process."""
    nccl_buffsize_bytes: PosInt
    """Simple-protocol buffer per connection (NCCL_BUFFSIZE)."""
    nccl_ll_buffer_bytes: PosInt
    """LL-protocol buffer per connection."""
    nccl_ll128_buffer_bytes: PosInt
    """LL128-protocol buffer per connection."""
    nccl_alloc_granularity_bytes: PosInt
    """cuMem allocation granularity the per-connection buffers are rounded up to."""
    nccl_coll_channels: PosInt
    """Channels of a collective (ring) communicator; one receive connection per channel."""
    nccl_p2p_channels_per_peer: PosInt
    """Channels per peer of a point-to-point (send/recv) connection over NVLink."""
    nccl_p2p_channels_per_net_peer: PosInt
    """Channels per peer over the network (NCCL_NCHANNELS_PER_NET_PEER)."""
    nccl_p2p_chunk_bytes: PosInt
    """P2P chunk over NVLink; a p2p buffer is chunk x NCCL_STEPS."""
    nccl_p2p_net_chunk_bytes: PosInt
    """P2P chunk over the network."""
    nccl_steps: PosInt
    """NCCL_STEPS: slots per connection buffer."""
    nccl_nvls_enable: StrictBool
    """NCCL_NVLS_ENABLE: NVLink SHARP buffers for communicators whose ranks share one NVLink domain."""
    nvls_channels: PosInt
    nvls_chunk_bytes: PosInt
    nvls_heads: PosInt
    """nHeads of NCCL's NVLS buffer formula (nChannels x 2 x chunk x NCCL_STEPS x nHeads)."""
    hybridep: StrictBool = True
    """The EP all-to-all runs through HybridEP (fixed buffers outside the allocator) instead of NCCL."""
    hybridep_token_bytes: PosInt = 2
    """Bytes per dispatched value in the HybridEP token buffer (BF16 dispatch)."""
    hybridep_prob_bytes: PosInt = 4
    """Bytes per routing probability (FP32) in the HybridEP probs buffer."""
    # -- inside the caching allocator (counted in allocated)
    cublas_workspace_bytes: PosInt
    cublas_handles: PosInt
    """(handle, stream) pairs with a cuBLAS workspace."""
    te_workspace_bytes: PosInt
    te_workspaces: PosInt
    """TransformerEngine GEMM workspaces: one for plain GEMMs plus one per grouped-GEMM compute stream."""
    # -- the caching allocator
    expandable_segments: StrictBool = False
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."""
    allocator_slack: NonNegFloat
    """(max reserved - max allocated) / max allocated without expandable segments."""
    allocator_slack_expandable_segments: NonNegFloat | None = None
    """The same ratio with expandable segments (no public ratio shipped: measure it)."""
    source: str = ""

    @model_validator(mode="after")
    def _slack(self) -> RuntimeSpec:
        if self.expandable_segments and self.allocator_slack_expandable_segments is None:
            raise ValueError("expandable_segments is true but allocator_slack_expandable_segments is not given; "
                             "measure (max reserved - max allocated) / max allocated with the flag and set it")
        return self

    @property
    def slack(self) -> float:
        """The allocator slack in force: reserved = allocated x (1 + slack)."""
        if self.expandable_segments:
            assert self.allocator_slack_expandable_segments is not None
            return self.allocator_slack_expandable_segments
        return self.allocator_slack

    @property
    def cuda_context_bytes(self) -> int:
        return int(round(self.cuda_context_mib * MIB))

    @property
    def nccl_connection_bytes(self) -> int:
        """One collective connection: Simple + LL + LL128 buffers, rounded up to the allocation granularity."""
        raw = self.nccl_buffsize_bytes + self.nccl_ll_buffer_bytes + self.nccl_ll128_buffer_bytes
        g = self.nccl_alloc_granularity_bytes
        return -(-raw // g) * g


def load_runtime(name_or_path: str | Path | RuntimeSpec = DEFAULT_RUNTIME) -> RuntimeSpec:
    """A runtime preset name (`megatron-te-hybridep-gb200`) or a path to a runtime TOML."""
    if isinstance(name_or_path, RuntimeSpec):
        return name_or_path
    return _load(RuntimeSpec, name_or_path, "runtime")



@dataclass(frozen=True)
class RuntimeChoice:
    """The runtime a job plans with (`name`; None: live tensors only) and where it comes from: `origin` is
    "job" (the job names it), "cluster default" (the job names none; its cluster's `default_runtime`), "none"
    (the job's `runtime = "none"`) or "no cluster default" (the job names none and neither does its cluster)."""

    name: str | None
    origin: str
    cluster: str

    def line(self) -> str:
        """One line for the plan's output."""
        if self.origin == "job":
            return f"runtime {self.name} (named by the job): every rank's device peak <= HBM - reserve"
        if self.origin == "cluster default":
            return (f"runtime {self.name} ({self.cluster}'s default_runtime; the job names none, runtime = \"none\" "
                    "plans on live tensors only): every rank's device peak <= HBM - reserve")
        why = "the job's runtime = \"none\"" if self.origin == "none" else f"{self.cluster} names no default_runtime"
        return f"runtime none ({why}): live tensors only, the reserve must cover the memory outside them"


def planning_runtime(job: Job, cluster: ClusterSpec | str | None = None) -> RuntimeChoice:
    """The runtime `job` plans with. A job that names no runtime takes its cluster's `default_runtime` (`cluster`:
    object, preset or path; default: the job's); `runtime = "none"` is live tensors only. A job resolved by
    resolve_job_runtime keeps the choice made then."""
    if job._runtime_from is not None:
        return job._runtime_from
    c = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster or job.cluster)
    if job.runtime == NO_RUNTIME:
        return RuntimeChoice(None, "none", c.name)
    if job.runtime is not None:
        return RuntimeChoice(job.runtime, "job", c.name)
    if c.default_runtime in (None, NO_RUNTIME):
        return RuntimeChoice(None, "no cluster default", c.name)
    return RuntimeChoice(c.default_runtime, "cluster default", c.name)


def resolve_job_runtime(job: Job, cluster: ClusterSpec | str | None = None) -> Job:
    """The job as the search reads it (k3opt.search.frames.allocated_capacity_bytes): `runtime` is the preset it
    plans with, or None for live tensors only (the search's HBM line is then HBM - reserve). k3opt.plan applies
    it once; a resolved job passes unchanged (its choice travels with it, see planning_runtime)."""
    if job._runtime_from is not None:
        return job
    choice = planning_runtime(job, cluster)
    if choice.name is not None:
        load_runtime(choice.name)  # an unknown name is one clear line here, before the search starts
    resolved = job.model_copy(update={"runtime": choice.name})
    resolved._runtime_from = choice
    return resolved
