"""k3opt: a constraint-solver layout planner for Kimi K3 training on GB200 NVL72.

Public API (stable names):
    load_model, load_cluster, load_layout, load_job, Layout, Job, evaluate, plan, pareto,
    load_runtime, RuntimeSpec (the memory outside live tensors), to_launch (a layout as launch settings)
"""

from k3opt.cost.evaluate import Evaluation, RankEvaluation, StepTime, evaluate
from k3opt.inputs.errors import (
    InfeasibleJobError,
    K3optError,
    LayoutError,
    PresetNotFoundError,
    SearchTimeoutError,
    SpecError,
)
from k3opt.inputs.presets import load_cluster, load_job, load_layout, load_model, load_runtime, make_layout
from k3opt.inputs.specs import ClusterSpec, Job, Layout, ModelSpec, RuntimeSpec, Toggles
from k3opt.launch import to_launch
from k3opt.planner import pareto, plan
from k3opt.search import Plan, PlanItem

__all__ = [
    "ClusterSpec", "Evaluation", "InfeasibleJobError", "Job", "K3optError", "Layout", "LayoutError",
    "ModelSpec", "PresetNotFoundError", "RankEvaluation", "SearchTimeoutError", "SpecError", "StepTime", "Toggles",
    "evaluate",
    "load_cluster", "load_job", "load_layout", "load_model", "make_layout", "Plan", "PlanItem", "pareto", "plan",
    "RuntimeSpec", "load_runtime", "to_launch",
]
__version__ = "0.1.0"
