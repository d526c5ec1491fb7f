"""Achievable rates: the fraction of a datasheet peak that real kernels and collectives reach, as named data.

A rates file (constraints/rates/<cluster>.toml) holds one entry per rate, each with its value, its unit, what
kind of number it is (measured, spec, derived, assumption) and its public source (a microbenchmark, a paper,
a vendor document). None of them comes from the throughput validation rows: those only check the result.

The cost model turns the rates into achievable ceilings (an empirical roofline) beside the peak ceilings:
    GEMM time          = FLOPs / (dense peak of the precision x GEMM fraction of its shape class)
    attention time     = forward FLOPs / (BF16 dense peak x attention-core fraction)
                         + backward FLOPs / (BF16 dense peak x attention-core backward fraction)
    HBM time           = bytes / (HBM peak x HBM fraction)
    EP all-to-all time = bytes / achievable all-to-all bandwidth of the dispatcher (inside / across a domain)
    other collectives  = bytes / (link peak x collective fraction)
                         + calls x NCCL ring latency (base + intra-domain steps x NVLink hop + inter-domain steps
                           x network hop, NCCL's tuning model), on the per-layer arrays of the link they cross
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, StrictBool, ValidationError, model_validator

from k3opt.inputs.errors import K3optError, PresetNotFoundError, SpecError
from k3opt.inputs.memo import Memo
from k3opt.inputs.presets import format_validation_error, load_spec, preset_dir, read_toml, resolve
from k3opt.inputs.specs import BF16, FP32, ClusterSpec, PosFloat, Precision, StrictModel

# NVIDIA/TransformerEngine@d0067d0da6cb01811b8072a7d304f0e00344ce2b transformer_engine/common/triton/cross_entropy.py,
# the fused cross entropy Megatron runs with cross_entropy_fusion_impl = 'te' (the Megatron-Bridge perf recipes'
# default, src/megatron/bridge/perf_recipes/_common.py@067f987d). The logits' write by the LM-head GEMM and its
# backward GEMMs' reads are GEMM traffic, not counted here.
TE_CROSS_ENTROPY_BYTES_PER_LOGIT = (
    BF16            # online_softmax_kernel reads the BF16 logits
    + BF16 + FP32   # cross_entropy_kernel reads them again and writes the FP32 gradient
    + FP32 + FP32   # backward element_mul_kernel scales it in place (Megatron passes a per-token loss,
                    # megatron/core/models/common/language_module/language_module.py@d98e8a64: grad_output is not 1)
    + FP32 + BF16   # autograd casts the FP32 gradient to the BF16 logits' dtype for the LM-head backward
)
"""HBM bytes TransformerEngine's fused cross entropy moves per logit element per microbatch: 22 B."""


_RATE_KINDS = Literal["measured", "spec", "derived", "assumption"]


class Rate(StrictModel):
    """One named achievable rate with its provenance."""

    value: PosFloat
    unit: str
    kind: _RATE_KINDS
    source: str = Field(min_length=1)
    """The public source: repository and file (with commit when pinned), paper, or vendor document."""
    note: str = ""
    sms: int | None = Field(default=None, gt=0)
    """For a communication kernel: the streaming multiprocessors it held while measured (taken from compute
    while it runs beside it)."""


class OverlapRules(StrictModel):
    """What hides under compute, as the framework schedules it."""

    ep_exposed_without_overlap: bool = True
    """EP dispatch/combine sit on the critical path of their own microbatch unless an overlap schedule is on."""
    dp_overlap_microbatches: float = Field(default=1.0, ge=0)
    """Data-parallel gradient reduce-scatter and parameter all-gather overlap with this many microbatches of
    compute (Megatron overlap_grad_reduce / overlap_param_gather: the last backward, the first forward)."""
    pp_overlapped: bool = True
    """Pipeline send/recv runs on its own stream beside compute."""
    vector_serial_with_tensor: bool = True
    """Memory-bound kernels run on the GEMMs' compute stream, in sequence with them."""
    ep_overlap_stages: StrictBool = False
    """Under an EP overlap schedule, each all-to-all hides only under the compute it is paired with in Megatron's
    combined 1F1B layer schedule (k3opt.cost.achievable.ep_overlap_stage_exposed), not under the whole layer; off: it
    hides under the whole stage (a lower bound)."""
    source: str = Field(min_length=1)


class LossKernels(StrictModel):
    """Which cross-entropy kernels run after the LM-head GEMM; the achievable step prices their HBM traffic from
    the tensors' dtypes (k3opt.cost.coefficients.loss_kernel_bytes)."""

    te_fused_cross_entropy: StrictBool
    """TransformerEngine's fused cross entropy (Megatron's cross_entropy_fusion_impl = 'te'); false: unpriced."""
    source: str = Field(min_length=1)


class SizeCurve(StrictModel):
    """GEMM rate relative to the large-shape rate, by cube-equivalent edge (M N K)^(1/3), log-interpolated and
    held flat beyond the ends."""

    edge: list[PosFloat]
    relative: list[PosFloat]
    source: str = Field(min_length=1)

    @model_validator(mode="after")
    def _shape(self) -> SizeCurve:
        if len(self.edge) != len(self.relative) or len(self.edge) < 2:
            raise ValueError("edge and relative need the same length (at least 2)")
        if any(b <= a for a, b in zip(self.edge, self.edge[1:], strict=False)):
            raise ValueError("edge must increase")
        return self


class GemmShapeTable(StrictModel):
    """Measured GEMM rates by shape (constraints/rates/gemm-shapes/<name>.toml): TFLOP/s of C[m, n] = A[m, k] B[k, n]
    at every (m, n, k) of `grid`, per operand-dtype column."""

    name: str
    unit: Literal["TFLOP/s"]
    source: str = Field(min_length=1)
    grid: list[PosFloat]
    tflops: dict[str, list[list[list[PosFloat]]]]

    @model_validator(mode="after")
    def _shape(self) -> GemmShapeTable:
        g = len(self.grid)
        if g < 2 or any(b <= a for a, b in zip(self.grid, self.grid[1:], strict=False)):
            raise ValueError("grid needs at least 2 increasing points")
        for col, cube in self.tflops.items():
            if len(cube) != g or any(len(row) != g or any(len(ks) != g for ks in row) for row in cube):
                raise ValueError(f"tflops.{col} must be {g} x {g} x {g} (m, n, k over the grid)")
        return self

    def rate(self, column: str, m: np.ndarray, n: np.ndarray, k: np.ndarray) -> np.ndarray:
        """TFLOP/s at (m, n, k): trilinear in log2 m, log2 n, log2 k between the grid points, each dimension held
        at the grid's end beyond it."""
        lg = np.log2(np.asarray(self.grid, dtype=float))
        cube = np.asarray(self.tflops[column], dtype=float)
        idx, frac = [], []
        for x in (m, n, k):
            t = np.clip(np.log2(np.asarray(x, dtype=float)), lg[0], lg[-1])
            i = np.clip(np.searchsorted(lg, t, side="right") - 1, 0, len(lg) - 2)
            idx.append(i)
            frac.append((t - lg[i]) / (lg[i + 1] - lg[i]))
        out = np.zeros(np.broadcast(*idx).shape)
        for di in (0, 1):
            for dj in (0, 1):
                for dl in (0, 1):
                    w = ((frac[0] if di else 1 - frac[0]) * (frac[1] if dj else 1 - frac[1])
                         * (frac[2] if dl else 1 - frac[2]))
                    out = out + w * cube[idx[0] + di, idx[1] + dj, idx[2] + dl]
        return out


def _read_gemm_table(name_or_path: str) -> GemmShapeTable:
    """A shipped GEMM shape table by name (constraints/rates/gemm-shapes/<name>.toml) or a path to one."""
    folder = preset_dir("rates") / "gemm-shapes"
    shipped = folder / f"{name_or_path}.toml"
    path = shipped if shipped.exists() else Path(name_or_path)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in folder.glob("*.toml"))) or "none"
        raise PresetNotFoundError(f"unknown GEMM shape table '{name_or_path}'; shipped: {known} (or give a path)")
    return load_spec(GemmShapeTable, path, "GEMM shape table")


load_gemm_table = Memo(_read_gemm_table, maxsize=8)


class GemmShape(StrictModel):
    """How a GEMM's rate depends on its shape: a measured per-shape table (GemmShapeTable), read relative to the
    shape each class fraction was measured at, so that the size penalty already inside a fraction is not counted
    twice: rate = peak x class fraction x table(m, n, k) / table(reference shape of the class)."""

    table: str = Field(min_length=1)
    """A shipped table's name (constraints/rates/gemm-shapes/) or a path to one."""
    columns: dict[Precision, str]
    """The table column each compute precision reads (a precision left out reads the cube-edge `gemm_size`)."""
    gradient_columns: dict[Precision, str] = Field(default_factory=dict)
    """The column the data- and weight-gradient GEMMs of a precision read when their operands differ from the
    forward's (the hybrid FP8 recipe: dY in E5M2 times an E4M3 operand); a precision left out reads `columns`."""
    dense_reference: tuple[PosFloat, PosFloat, PosFloat]
    """(m, n, k) the gemm_dense fractions were measured at."""
    grouped_reference: tuple[PosFloat, PosFloat, PosFloat]
    """(m, n, k) of one group of the gemm_grouped measurement."""
    source: str = Field(min_length=1)

    @model_validator(mode="after")
    def _known(self) -> GemmShape:
        try:
            tab = load_gemm_table(self.table)
        except (K3optError, OSError) as err:
            raise ValueError(f"gemm_shape.table '{self.table}': {err}") from None
        missing = sorted({*self.columns.values(), *self.gradient_columns.values()} - tab.tflops.keys())
        if missing:
            raise ValueError(f"gemm_shape.columns name {', '.join(missing)}, not in table {tab.name} (it has "
                             f"{', '.join(sorted(tab.tflops))})")
        extra = sorted(p.value for p in self.gradient_columns.keys() - self.columns.keys())
        if extra:
            raise ValueError(f"gemm_shape.gradient_columns name {', '.join(extra)}, which `columns` does not: give "
                             f"the forward's column too")
        return self

    def factor(self, precision: Precision, routed: np.ndarray, m: np.ndarray, n: np.ndarray,
               k: np.ndarray, gradient: bool = False) -> np.ndarray:
        """table(m, n, k) / table(the class's reference shape), per GEMM (routed: grouped class). A gradient GEMM
        (`gradient`) reads its own column where `gradient_columns` names one; the reference stays the forward
        column's, the operands the class fractions were measured with."""
        tab = load_gemm_table(self.table)
        col = self.columns[precision]
        ref = np.where(np.asarray(routed) > 0, tab.rate(col, *self.grouped_reference),
                       tab.rate(col, *self.dense_reference))
        if gradient:
            col = self.gradient_columns.get(precision, col)
        return tab.rate(col, m, n, k) / ref


class RatesSpec(StrictModel):
    """Achievable rates of one cluster preset."""

    name: str
    cluster: str
    """The cluster preset these rates were measured on (or transferred to, see each rate's note)."""
    gemm_dense: dict[Precision, Rate]
    """Large dense linear-layer GEMMs: fraction of the precision's dense peak."""
    gemm_grouped: dict[Precision, Rate]
    """Grouped expert GEMMs (one GEMM per local expert): fraction of the precision's dense peak."""
    attention_core: Rate
    """Fused attention (score/value contractions, BF16): fraction of the BF16 dense peak."""
    attention_core_backward: Rate | None = None
    """The same for the attention backward kernels (absent: the forward rate)."""
    hbm: Rate
    """Streaming kernels: fraction of the HBM peak."""
    hbm_quantize: Rate | None = None
    """The MXFP8 / FP8 cast kernels (BF16 in, row- and column-wise copies out): fraction of the HBM peak (absent:
    `hbm`)."""
    collective_nvlink: Rate
    """All-gather / reduce-scatter / send-recv inside an NVLink domain: fraction of the NVLink peak."""
    collective_nic: Rate
    """The same across domains: fraction of the NIC peak."""
    a2a_nvlink_gbps: dict[str, Rate]
    """EP dispatch/combine inside one NVLink domain, per dispatcher: achieved algorithm bandwidth per GPU."""
    a2a_nic_gbps: dict[str, Rate]
    """EP dispatch/combine across domains, per dispatcher: achieved bandwidth per GPU."""
    overlap: OverlapRules
    gemm_size: SizeCurve | None = None
    """How much slower small GEMMs run than the large ones the class fractions were measured on (absent: 1), by
    cube-equivalent edge; read only for a precision `gemm_shape` has no column for."""
    gemm_shape: GemmShape | None = None
    """The measured per-shape GEMM rates (absent: the cube-edge `gemm_size` curve)."""
    collective_base_latency_us: Rate | None = None
    """Fixed latency of one NCCL collective call, microseconds (absent, with the hop latencies: no latency term)."""
    collective_hop_latency_nvlink_us: Rate | None = None
    """Latency of one ring step between two GPUs of an NVLink domain, microseconds."""
    collective_hop_latency_nic_us: Rate | None = None
    """Latency of one ring step across NVLink domains (the network), microseconds."""
    loss_kernels: LossKernels | None = None
    """The cross-entropy kernels the runs use (absent: the loss kernels are unpriced)."""

    @model_validator(mode="before")
    @classmethod
    def _retired_loss_bytes(cls, data: Any) -> Any:  # noqa: ANN401 - the raw TOML table
        """`loss_bytes_per_logit` (a hand-summed byte count) is retired: its one value, TransformerEngine's 22 B,
        is now derived from dtypes. A file naming that value loads as `[loss_kernels] te_fused_cross_entropy =
        true` with a FutureWarning; any other value is one clear error (the model cannot price it)."""
        if not isinstance(data, dict) or "loss_bytes_per_logit" not in data:
            return data
        old = data["loss_bytes_per_logit"]
        value = old.get("value") if isinstance(old, dict) else old
        fix = ("replace the [loss_bytes_per_logit] table with [loss_kernels] te_fused_cross_entropy = true (or false) "
               "and its source")
        if "loss_kernels" in data:
            raise ValueError(f"loss_bytes_per_logit is retired and [loss_kernels] is given too; {fix}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or value != TE_CROSS_ENTROPY_BYTES_PER_LOGIT:
            raise ValueError(f"loss_bytes_per_logit = {value!r} is no longer read: the loss kernels' bytes are "
                             f"derived from their dtypes ({TE_CROSS_ENTROPY_BYTES_PER_LOGIT} B per logit for "
                             f"TransformerEngine's fused cross entropy); {fix}")
        warnings.warn(f"rates {data.get('name', '')}: loss_bytes_per_logit is deprecated and read as [loss_kernels] "
                      f"te_fused_cross_entropy = true; {fix}", FutureWarning, stacklevel=2)
        source = old.get("source") if isinstance(old, dict) else None
        kernels = {"te_fused_cross_entropy": True, "source": source or "loss_bytes_per_logit (retired field)"}
        return {**{k: v for k, v in data.items() if k != "loss_bytes_per_logit"}, "loss_kernels": kernels}

    def ring_latency_s(self, n: int, a: int) -> float:
        """Seconds of latency of one ring all-gather or reduce-scatter over n ranks, a of them per NVLink domain,
        as NCCL's tuning model prices a ring (NVIDIA/nccl src/graph/tuning.cc, latencies[coll][ring][proto]):
        base + (n - 1 - (n/a - 1)) x NVLink hop + (n/a - 1) x network hop; 0 for n = 1 or without latencies."""
        base, hv, hn = (self.collective_base_latency_us, self.collective_hop_latency_nvlink_us,
                        self.collective_hop_latency_nic_us)
        if n <= 1 or base is None or hv is None or hn is None:
            return 0.0
        inter = max(n // max(a, 1) - 1, 0)
        return 1e-6 * (base.value + (n - 1 - inter) * hv.value + inter * hn.value)

    def size_factor(self, edge: np.ndarray) -> np.ndarray:
        """Relative GEMM rate at cube-equivalent edge `edge` (1 without a curve)."""
        if self.gemm_size is None:
            return np.ones_like(edge, dtype=float)
        c = self.gemm_size
        return np.interp(np.log2(edge), np.log2(c.edge), c.relative)

    def shape_factors(self, precision: Precision, routed: np.ndarray, m: np.ndarray, n: np.ndarray,
                      k: np.ndarray, gradient: bool = False) -> np.ndarray | None:
        """Per GEMM, its rate relative to its class fraction's (GemmShape.factor; `gradient`: a data- or
        weight-gradient GEMM); None when no table column serves the precision (the caller then reads the cube-edge
        curve)."""
        gs = self.gemm_shape
        if gs is None or precision not in gs.columns:
            return None
        return gs.factor(precision, routed, m, n, k, gradient)

    def gemm(self, kind: str, precision: Precision) -> float:
        table = self.gemm_dense if kind == "dense" else self.gemm_grouped
        if precision not in table:
            raise SpecError(f"rates {self.name}: no gemm_{kind} rate for {precision.value}; add "
                            f"[gemm_{kind}.{precision.value}] with its source")
        return table[precision].value

    def attention_backward(self) -> float:
        """Fraction of the BF16 peak the attention backward reaches (the forward's without its own rate)."""
        r = self.attention_core_backward
        return (r or self.attention_core).value

    def a2a(self, dispatcher: str, where: str) -> float:
        table = self.a2a_nvlink_gbps if where == "nvlink" else self.a2a_nic_gbps
        if dispatcher not in table:
            raise SpecError(f"rates {self.name}: no a2a_{where}_gbps rate for dispatcher '{dispatcher}'; known: "
                            f"{', '.join(sorted(table))}")
        return table[dispatcher].value

    def a2a_sms(self, dispatcher: str) -> int:
        """SMs the dispatcher's kernels hold (0 when the rates file does not say)."""
        r = self.a2a_nvlink_gbps.get(dispatcher)
        return r.sms or 0 if r is not None else 0

    def named(self) -> dict[str, Rate]:
        """Every rate under one flat name (for reports)."""
        out: dict[str, Rate] = {}
        for p, r in self.gemm_dense.items():
            out[f"gemm_dense.{p.value}"] = r
        for p, r in self.gemm_grouped.items():
            out[f"gemm_grouped.{p.value}"] = r
        for key in ("attention_core", "hbm", "collective_nvlink", "collective_nic"):
            out[key] = getattr(self, key)
        if self.attention_core_backward is not None:
            out["attention_core_backward"] = self.attention_core_backward
        if self.hbm_quantize is not None:
            out["hbm_quantize"] = self.hbm_quantize
        for key in ("collective_base_latency_us", "collective_hop_latency_nvlink_us", "collective_hop_latency_nic_us"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        for d, r in self.a2a_nvlink_gbps.items():
            out[f"a2a_nvlink_gbps.{d}"] = r
        for d, r in self.a2a_nic_gbps.items():
            out[f"a2a_nic_gbps.{d}"] = r
        return out


def load_rates(name_or_path: str) -> RatesSpec:
    """A rates preset name (`gb200-nvl72`) or a path to a rates TOML. A relative `gemm_shape.table` path in it is
    read against the rates file's folder, not the working directory (as the file's author wrote it)."""
    path = resolve(name_or_path, "rates")
    data = read_toml(path, f"rates {path.name}")
    data = _table_beside(data, path.parent)
    try:
        return RatesSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, f"rates {path.name}")) from None


def _table_beside(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """`data` with a relative `gemm_shape.table` path made absolute against `folder`; a shipped table's name
    (constraints/rates/gemm-shapes/<name>.toml) and an absolute path stay as written."""
    gs = data.get("gemm_shape")
    table = gs.get("table") if isinstance(gs, dict) else None
    if not isinstance(table, str) or not table or Path(table).is_absolute():
        return data
    if (preset_dir("rates") / "gemm-shapes" / f"{table}.toml").exists():
        return data
    return {**data, "gemm_shape": {**gs, "table": str((folder / table).resolve())}}


def rates_for(cluster: ClusterSpec) -> RatesSpec | None:
    """The shipped rates file named like the cluster preset, or None when there is none."""
    return _shipped_rates(cluster.name)


def _read_shipped_rates(name: str) -> RatesSpec | None:
    path = preset_dir("rates") / f"{name}.toml"
    return load_rates(str(path)) if path.exists() else None


_shipped_rates = Memo(_read_shipped_rates, maxsize=32)
