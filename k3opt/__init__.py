"""k3opt: a constraint-solver layout planner for Kimi K3 training on GB200 NVL72.

Public API (stable names):
    load_model, load_cluster, load_layout, load_job, Layout, Job, evaluate, plan,
    load_runtime, RuntimeSpec (the memory outside live tensors)
"""

from k3opt.errors import InfeasibleJobError, K3optError, LayoutError, PresetNotFoundError, SpecError
from k3opt.evaluate import Evaluation, RankEvaluation, StepTime, evaluate
from k3opt.launch import plan  # search.plan, honouring job.target (k3opt.launch.limits)
from k3opt.runtime import RuntimeSpec, load_runtime
from k3opt.search import Plan, PlanItem
from k3opt.specs import (
    ClusterSpec,
    Job,
    Layout,
    ModelSpec,
    Toggles,
    load_cluster,
    load_job,
    load_layout,
    load_model,
    make_layout,
)

__all__ = [
    "ClusterSpec", "Evaluation", "InfeasibleJobError", "Job", "K3optError", "Layout", "LayoutError",
    "ModelSpec", "PresetNotFoundError", "RankEvaluation", "SpecError", "StepTime", "Toggles", "evaluate",
    "load_cluster", "load_job", "load_layout", "load_model", "make_layout", "Plan", "PlanItem", "plan",
    "RuntimeSpec", "load_runtime",
]
__version__ = "0.1.0"
