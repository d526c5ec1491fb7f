"""The lab's controls as typed inputs: a form (the page's control values, by control name) read into a Layout or a
Job with the library's own validation, and every failure turned into the CLI's one-line message with the name of
the control it belongs beside (`FieldError`)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from k3opt.inputs.errors import K3optError, LayoutError, SpecError
from k3opt.inputs.presets import format_validation_error, load_cluster, load_model, load_runtime, preset_names
from k3opt.inputs.specs import (
    TOGGLE_NAMES,
    ClusterSpec,
    CudaGraphImpl,
    CudaGraphModule,
    Dtype,
    FsdpLifecycle,
    Job,
    Layout,
    ModelSpec,
    OffloadModule,
    ParamGather,
    Precision,
    Recompute,
    RecomputeModule,
    RuntimeSpec,
    ShardingPolicy,
    check_layout,
    trained_model,
)
from k3opt.launch import FORMATS

INT_CONTROLS = ("gpus", "pp", "vp", "cp", "ep", "expert_fsdp", "dense_fsdp", "microbatches", "rows", "context")
"""Layout degrees and sizes: positive integers."""
OPTIONAL_INT_CONTROLS = ("domain_gpus_used",)
"""Positive integers or empty (the whole domain)."""
FLOAT_CONTROLS = ("reserve_gib",)
CHOICE_CONTROLS: dict[str, tuple[str, ...]] = {
    "recompute": tuple(Recompute), "fsdp_lifecycle": tuple(FsdpLifecycle),
    "dense_sharding": tuple(ShardingPolicy), "expert_sharding": tuple(ShardingPolicy),
    "grad_dtype": tuple(Dtype), "optimizer_state_dtype": ("model", *Dtype), "precision": tuple(Precision),
    "param_gather": tuple(ParamGather), "cuda_graph_impl": ("unstated", *CudaGraphImpl),
    "fp8_param_gather": ("off", "on"),
}
PRESET_CONTROLS = {"model": "model", "cluster": "cluster", "runtime": "runtime"}
"""Controls that name a shipped preset (never a path: the page cannot make the server read a file)."""
RUNTIME_CHOICES = ("cluster-default", "none")
"""The runtime control's values beside the presets: the cluster's default_runtime (as a planned job gets) or live
tensors only."""
JOB_INT_CONTROLS = ("tokens_per_update", "top")
JOB_FLOAT_CONTROLS = ("time_limit",)
TARGET_CHOICES = ("none",) + FORMATS

MAX_TIME_LIMIT_S = 600.0
"""The longest plan the lab runs: a browser tab waits on it, and a longer search belongs to the CLI or a sweep."""
MAX_TOP = 20


class FieldError(K3optError):
    """Bad input on one control: the CLI's one-line message, and the control it belongs beside (None: the form as a
    whole)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def _int(form: dict[str, Any], name: str) -> int:
    v = form.get(name)
    if isinstance(v, bool) or v is None or (isinstance(v, str) and not v.strip()):
        raise FieldError(f"{name}: a positive whole number is required", name)
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise FieldError(f"{name}: '{v}' is not a number; give a positive whole number", name) from None
    if f != int(f) or f <= 0:
        raise FieldError(f"{name}: {v} is not a positive whole number", name)
    return int(f)


def _float(form: dict[str, Any], name: str) -> float:
    v = form.get(name)
    try:
        f = float(v) if not isinstance(v, bool) and v not in (None, "") else float("nan")
    except (TypeError, ValueError):
        raise FieldError(f"{name}: '{v}' is not a number", name) from None
    if f != f or f < 0 or f == float("inf"):
        raise FieldError(f"{name}: '{v}' is not a number >= 0", name)
    return f


def _choice(form: dict[str, Any], name: str, allowed: tuple[str, ...]) -> str:
    v = form.get(name)
    if v not in allowed:
        raise FieldError(f"{name}: unknown value '{v}'; one of {', '.join(allowed)}", name)
    return str(v)


def parse_split(text: Any, chunks: int, layers: int) -> list[int]:
    """A split as the plan table writes it ('12x7+9': 7 chunks of 12 layers, then 9), as a list ('12,12,9' or
    '12 12 9'), or empty / 'even' for the even split (layers spread as equally as the chunks allow, the larger
    chunks first)."""
    s = str(text if text is not None else "").strip()
    if s in ("", "even"):
        base, extra = divmod(layers, chunks)
        if base == 0:
            raise FieldError(f"split: {layers} layers cannot fill pp x vp = {chunks} chunks of at least one layer",
                             "split")
        return [base + 1] * extra + [base] * (chunks - extra)
    out: list[int] = []
    for tok in re.split(r"[+,\s]+", s):
        m = re.fullmatch(r"(\d+)(?:x(\d+))?", tok)
        if not m:
            raise FieldError(f"split: '{tok}' is not LAYERS or LAYERSxCHUNKS (write e.g. 12x7+9, or leave it empty "
                             "for the even split)", "split")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def presets(form: dict[str, Any]) -> tuple[ModelSpec, ClusterSpec, RuntimeSpec | None, str | None]:
    """The model, cluster and runtime the form names (shipped presets only), and the runtime's name for a Layout
    (None: the cluster's default; 'none': live tensors only)."""
    model = load_model(_choice(form, "model", tuple(preset_names("model"))))
    cluster = load_cluster(_choice(form, "cluster", tuple(preset_names("cluster"))))
    rt = _choice(form, "runtime", RUNTIME_CHOICES + tuple(preset_names("runtime")))
    name = cluster.default_runtime if rt == "cluster-default" else rt
    spec = load_runtime(name) if name not in (None, "none") else None
    return model, cluster, spec, name or "none"


def _which(message: str, names: tuple[str, ...], changed: Any = None) -> str | None:
    """The control a cross-field message belongs beside: the one the user just changed (`changed`, sent by the
    page) when the message names it, else the first it names ('ep (7) must divide ...' belongs beside ep)."""
    words = [w for w in re.findall(r"[a-z_]+", message) if w in names]
    if changed in words:
        return str(changed)
    return words[0] if words else None


MODULE_CONTROLS: dict[str, tuple[tuple[str, ...], str]] = {
    "recompute_modules": (tuple(RecomputeModule), "for k3opt's selective set"),
    "offload_modules": (tuple(OffloadModule), "to offload no module"),
    "cuda_graph_modules": (tuple(CudaGraphModule), "to graph the whole layer"),
}
"""Megatron module lists (--recompute-modules, --offload-modules, --cuda-graph-modules): the known names and what an
empty control means."""


COUNT_CONTROLS = ("activation_offload_layers",)
"""Whole numbers >= 0, empty meaning 0."""
MODEL_COUNT_CONTROLS = ("mtp_layers",)
"""Whole numbers >= 0, empty meaning the model preset's own count."""
LAYOUT_CONTROLS = (*INT_CONTROLS, *OPTIONAL_INT_CONTROLS, *COUNT_CONTROLS, *MODEL_COUNT_CONTROLS, *FLOAT_CONTROLS,
                   "split", "pipeline_layout", *MODULE_CONTROLS, *CHOICE_CONTROLS, "toggles")


def _count(form: dict[str, Any], name: str) -> int:
    v = form.get(name)
    if v in (None, "") or v == "0" or v == 0:
        return 0
    return _int(form, name)


def _model_count(form: dict[str, Any], name: str) -> int | None:
    """A count the model preset sets when the control is empty (None); else a whole number >= 0."""
    v = form.get(name)
    if v is None or (isinstance(v, str) and not v.strip()):
        return None
    if v == "0" or v == 0:
        return 0
    try:
        return _int(form, name)
    except FieldError:
        raise FieldError(f"{name}: '{v}' is not a whole number >= 0 (leave it empty for the model's own)",
                         name) from None


def parse_modules(text: Any, control: str) -> list[str]:
    """A Megatron module list as a comma- or space-separated list ('mla_up_proj, mlp'); empty: none."""
    known, empty = MODULE_CONTROLS[control]
    names = [t for t in re.split(r"[,\s]+", str(text if text is not None else "").strip()) if t]
    bad = next((n for n in names if n not in known), None)
    if bad is not None:
        raise FieldError(f"{control}: unknown module '{bad}'; known: {', '.join(known)} (or leave it empty {empty})",
                         control)
    return names


def layout_from_form(form: dict[str, Any]) -> tuple[Layout, ModelSpec, ClusterSpec, RuntimeSpec | None]:
    """The Layout the controls describe, checked as `k3opt explain` checks a layout file (Layout's validators,
    then check_layout against the model); any failure is a FieldError beside its control."""
    model, cluster, runtime, rt_name = presets(form)
    fields: dict[str, Any] = {k: _int(form, k) for k in INT_CONTROLS}
    for k in OPTIONAL_INT_CONTROLS:
        fields[k] = None if form.get(k) in (None, "") else _int(form, k)
    fields.update({k: _count(form, k) for k in COUNT_CONTROLS})
    fields.update({k: _model_count(form, k) for k in MODEL_COUNT_CONTROLS})
    fields.update({k: _float(form, k) for k in FLOAT_CONTROLS})
    fields.update({k: _choice(form, k, allowed) for k, allowed in CHOICE_CONTROLS.items()})
    if fields["optimizer_state_dtype"] == "model":  # the model's [optimizer] state_dtype
        fields["optimizer_state_dtype"] = None
    if fields["cuda_graph_impl"] == "unstated":  # the exports then leave Megatron's default
        fields["cuda_graph_impl"] = None
    fields["fp8_param_gather"] = fields["fp8_param_gather"] == "on"
    text = str(form.get("pipeline_layout") or "").strip()
    if text:
        # Megatron's layout string sets the split (Layout reads it); the split control then only shows it.
        fields["pipeline_layout"] = text
    else:
        try:
            fields["split"] = parse_split(form.get("split"), fields["pp"] * fields["vp"], model.num_layers)
        except FieldError as err:
            raise FieldError(str(err), _which(str(err), LAYOUT_CONTROLS, form.get("changed"))) from None
    fields.update({k: parse_modules(form.get(k), k) for k in MODULE_CONTROLS})
    toggles = form.get("toggles") or {}
    if not isinstance(toggles, dict) or any(k not in TOGGLE_NAMES or not isinstance(v, bool)
                                            for k, v in toggles.items()):
        bad = next((k for k in toggles if k not in TOGGLE_NAMES), None) if isinstance(toggles, dict) else None
        raise FieldError(f"toggles: unknown toggle '{bad}'; known: {', '.join(TOGGLE_NAMES)}" if bad else
                         "toggles: each toggle is true or false", "toggles")
    fields["toggles"] = toggles
    fields.update(model=model.name, cluster=cluster.name, runtime=rt_name)
    try:
        layout = Layout.model_validate(fields)
    except ValidationError as err:
        first = err.errors()[0]
        loc = str(first["loc"][0]) if first["loc"] else None
        line = format_validation_error(err, "layout", Layout)
        changed = form.get("changed")
        raise FieldError(line, loc if loc in LAYOUT_CONTROLS else _which(line, LAYOUT_CONTROLS, changed)) from None
    try:
        check_layout(layout, model, cluster)
        trained_model(layout, model)
    except LayoutError as err:
        raise FieldError(str(err), _which(str(err), LAYOUT_CONTROLS, form.get("changed"))) from None
    return layout, model, cluster, runtime


JOB_CONTROLS = ("gpus", "context", "rows", "reserve_gib", "domain_gpus_used", "tokens_per_update", "target",
                "precision", "mtp_layers")


def job_from_form(form: dict[str, Any]) -> tuple[Job, ModelSpec, ClusterSpec, int, float]:
    """The Job the plan controls describe (the explorer's model, cluster, runtime, GPUs, context and reserve, plus
    tokens per update and the launch target), with the plan's `top` and time limit bounded for the lab."""
    model, cluster, _, rt_name = presets(form)
    top = _int(form, "top")
    if top > MAX_TOP:
        raise FieldError(f"top: at most {MAX_TOP} layouts in the lab (the CLI's --top has no cap)", "top")
    limit = _float(form, "time_limit")
    if not 0 < limit <= MAX_TIME_LIMIT_S:
        raise FieldError(f"time_limit: {limit:g} s is outside (0, {MAX_TIME_LIMIT_S:g}] s; a longer search belongs "
                         "to `k3opt plan` or `k3opt sweep`", "time_limit")
    target = _choice(form, "target", TARGET_CHOICES)
    fields: dict[str, Any] = {k: _int(form, k) for k in ("gpus", "context", "rows", "tokens_per_update")}
    fields["reserve_gib"] = _float(form, "reserve_gib")
    if form.get("domain_gpus_used") not in (None, ""):
        fields["domain_gpus_used"] = _int(form, "domain_gpus_used")
    fields["mtp_layers"] = _model_count(form, "mtp_layers")
    fields["precisions"] = [_choice(form, "precision", CHOICE_CONTROLS["precision"])]
    fields.update(model=model.name, cluster=cluster.name, name="lab",
                  runtime=None if form.get("runtime") == "cluster-default" else rt_name,
                  target=None if target == "none" else target)
    try:
        job = Job.model_validate(fields)
    except ValidationError as err:
        line = format_validation_error(err, "job", Job)
        loc = str(err.errors()[0]["loc"][0]) if err.errors()[0]["loc"] else None
        raise FieldError(line, loc if loc in JOB_CONTROLS else _which(line, JOB_CONTROLS, form.get("changed"))) \
            from None
    try:
        trained_model(job, model)
    except SpecError as err:
        raise FieldError(str(err), "mtp_layers") from None
    return job, model, cluster, top, limit


__all__ = ["FieldError", "job_from_form", "layout_from_form", "parse_split", "presets", "SpecError"]
