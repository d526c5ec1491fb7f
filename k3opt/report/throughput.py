"""Throughput validation: predicted vs measured tokens/s per GPU for the public Megatron-Bridge runs.

Each measured layout (layouts/measured/*.toml with a `[measured] tokens_per_s_per_gpu`) names its source: the
Megatron-Bridge performance table row and the perf recipe (commit 067f987d) its settings come from. The
prediction is the achievable step time (k3opt.cost.achievable); the peak-ceiling roofline is shown beside it. Every
rate the prediction uses comes from constraints/rates, never from these rows:

    error % = 100 x (predicted - measured) / measured          MAE = mean |error %|
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from k3opt.cost.evaluate import evaluate
from k3opt.inputs.errors import K3optError
from k3opt.inputs.labels import cuda_graphs_text
from k3opt.inputs.presets import load_layout
from k3opt.report.validate import measured_layouts as all_measured_layouts

NOT_EXPRESSIBLE: dict[str, str] = {
    "MB-23": "DeepSeek-V3 FP8-MX (25.11) at PP8 / VP4 / EP32: the pinned recipes hold no PP8 x VP4 pipeline layout "
             "for 61 layers (32 chunks), and a loss-only chunk has no k3opt split",
}
"""Rows of the public table the model cannot express, with the reason."""


@dataclass(frozen=True)
class ThroughputRow:
    id: str
    model: str
    cluster: str
    gpus: int
    precision: str
    measured_tps_per_gpu: float
    predicted_tps_per_gpu: float
    """At the achievable rates (the planner's ranking figure)."""
    roofline_tps_per_gpu: float
    """At the peak ceilings (the optimistic bound)."""
    error_pct: float
    roofline_error_pct: float
    binding: str
    source: str
    flops_per_token: float = 0.0
    """k3opt's model FLOPs per token (6 x active matrices + causal attention)."""
    measured_flops_per_token: float | None = None
    """The run's: its model TFLOP/s per GPU / its tokens/s per GPU (Megatron's FLOP count)."""
    stage_ms: float = 0.0
    """The achievable stage time per stage-microbatch (slowest rank), ms."""
    stage_gap_ms: float = 0.0
    """GAP: what the measurement leaves per stage-microbatch beyond it, (measured step - achievable update - unpaired
    all-to-all) / slots - stage, ms; negative when the prediction is slower."""
    layers_per_rank: float = 0.0
    """Decoder layers per pipeline rank (L / PP), to read the GAP per layer."""
    cuda_graphs: str = "-"
    """The run's CUDA graph capture (k3opt.inputs.labels.cuda_graphs_text): unpriced, shown beside the error."""


@dataclass(frozen=True)
class ThroughputValidation:
    rows: tuple[ThroughputRow, ...]
    mean_abs_error_pct: float
    max_abs_error_pct: float
    roofline_mean_abs_error_pct: float
    not_expressible: dict[str, str]

    def to_dict(self) -> dict:
        return {"rows": [asdict(r) for r in self.rows], "mean_abs_error_pct": self.mean_abs_error_pct,
                "max_abs_error_pct": self.max_abs_error_pct,
                "roofline_mean_abs_error_pct": self.roofline_mean_abs_error_pct,
                "not_expressible": self.not_expressible}


def measured_layouts(folder: Path | None = None) -> list[Path]:
    """The shipped measured layouts that carry a tokens/s measurement, in row order."""
    paths = []
    for p in all_measured_layouts(folder):
        lay = load_layout(p)
        if lay.measured is not None and lay.measured.tokens_per_s_per_gpu is not None:
            paths.append(p)

    def row_number(p: Path) -> tuple[int, str]:
        head = p.stem.split("-")
        return (int(head[1]) if len(head) > 1 and head[1].isdigit() else 10**6, p.stem)

    return sorted(paths, key=row_number)


def validate_throughput(folder: Path | None = None) -> ThroughputValidation:
    """Predicted vs measured tokens/s per GPU for every measured layout, and the mean absolute error."""
    rows = []
    for path in measured_layouts(folder):
        lay = load_layout(path)
        ev = evaluate(lay)
        st = ev.step
        if st.achievable_tokens_per_s_per_gpu is None:
            raise K3optError(f"{path.name}: cluster {ev.cluster.name} has no rates file in constraints/rates; "
                             "add one to validate its throughput")
        measured = float(lay.measured.tokens_per_s_per_gpu)
        pred, roof = st.achievable_tokens_per_s_per_gpu, st.tokens_per_s_per_gpu
        measured_step = st.tokens_per_update / (measured * lay.gpus)
        rows.append(ThroughputRow(
            id=lay.name or path.stem, model=ev.model.name, cluster=ev.cluster.name, gpus=lay.gpus,
            precision=lay.precision.value, measured_tps_per_gpu=measured, predicted_tps_per_gpu=pred,
            roofline_tps_per_gpu=roof, error_pct=100 * (pred - measured) / measured,
            roofline_error_pct=100 * (roof - measured) / measured, binding=st.achievable_binding,
            source=lay.source, flops_per_token=st.model_flops_per_token,
            measured_flops_per_token=(lay.measured.model_tflops_per_gpu * 1e12 / measured
                                      if lay.measured.model_tflops_per_gpu else None),
            stage_ms=1e3 * st.achievable_stage_time_s,
            stage_gap_ms=1e3 * ((measured_step - st.achievable_update_time_s - st.achievable_unpaired_ep_s) / st.slots
                                - st.achievable_stage_time_s),
            layers_per_rank=ev.model.num_layers / lay.pp, cuda_graphs=cuda_graphs_text(lay),
        ))
    if not rows:
        raise K3optError("no measured layouts with tokens_per_s_per_gpu found")
    errs = [abs(r.error_pct) for r in rows]
    return ThroughputValidation(
        rows=tuple(rows), mean_abs_error_pct=sum(errs) / len(errs), max_abs_error_pct=max(errs),
        roofline_mean_abs_error_pct=sum(abs(r.roofline_error_pct) for r in rows) / len(rows),
        not_expressible=dict(NOT_EXPRESSIBLE),
    )


def validation_table(v: ThroughputValidation) -> str:
    """A markdown table (the README shows the same)."""
    out = ["| row | model | system | GPUs | precision | measured TPS/GPU | predicted (achievable) | error | "
           "roofline (peak) | roofline error | binding | GFLOP/token k3opt / run | CUDA graphs (unpriced) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in v.rows:
        fl = (f"{r.flops_per_token / 1e9:.1f} / {r.measured_flops_per_token / 1e9:.1f}"
              if r.measured_flops_per_token else f"{r.flops_per_token / 1e9:.1f} / -")
        out.append(f"| {r.id} | {r.model} | {r.cluster} | {r.gpus} | {r.precision} | {r.measured_tps_per_gpu:,.0f} | "
                   f"{r.predicted_tps_per_gpu:,.0f} | {r.error_pct:+.1f}% | {r.roofline_tps_per_gpu:,.0f} | "
                   f"{r.roofline_error_pct:+.1f}% | {r.binding} | {fl} | {r.cuda_graphs} |")
    out.append("")
    out.append(f"Mean absolute error (achievable): {v.mean_abs_error_pct:.1f}%; largest: {v.max_abs_error_pct:.1f}%; "
               f"peak roofline: {v.roofline_mean_abs_error_pct:.1f}%.")
    for rid, why in v.not_expressible.items():
        out.append(f"Not expressible: {rid}: {why}.")
    out.append("")
    out.append("GAP per stage-microbatch (what the measured step leaves beyond the achievable stage: "
               "(measured step - achievable update - unpaired all-to-all) / slots - stage; never a scale factor):")
    for r in v.rows:
        per_layer = r.stage_gap_ms / r.layers_per_rank if r.layers_per_rank else 0.0
        out.append(f"  {r.id:<6} stage {r.stage_ms:8.1f} ms, GAP {r.stage_gap_ms:+8.1f} ms "
                   f"({100 * r.stage_gap_ms / r.stage_ms:+.0f}%; {per_layer:+.2f} ms per layer, "
                   f"{r.layers_per_rank:g} layers a rank)")
    return "\n".join(out)
