"""Which runtime a job plans with: the one it names, its cluster's `default_runtime`, or none (live tensors only).

The runtime preset itself (k3opt.inputs.specs.RuntimeSpec) holds the software stack's memory outside the ledger's
live tensors; k3opt.cost.memory_outside builds the memory items from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3opt.inputs.presets import load_cluster, load_runtime
from k3opt.inputs.specs import NO_RUNTIME, ClusterSpec, Job


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
