"""The runtime preset: the software stack's memory outside the ledger's live tensors, as named, sourced data.

A runtime file (constraints/runtimes/*.toml) holds the sizes the memory items of `k3opt.memory_outside` are
built from: the CUDA context, NCCL's per-connection and per-channel buffers, NVLS buffers, the HybridEP
dispatcher's buffers, cuBLAS / TransformerEngine workspaces and the caching allocator's slack, plus the
environment knobs that change them (NCCL_NVLS_ENABLE, NCCL_BUFFSIZE, PYTORCH_CUDA_ALLOC_CONF). Every value is a
field a user can override with a measurement; the shipped preset names its source beside each value.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import model_validator

from k3opt.specs import MIB, NonNegFloat, PosFloat, PosInt, StrictBool, _load, _Strict

DEFAULT_RUNTIME = "megatron-te-hybridep-gb200"


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
