"""Where a job's ranks go: the racks (NVLink domains) it may hold and the GPUs it runs on. A job may give `gpus`,
`racks`, or both; `resolve_placement` checks them against the cluster and, for a job that gives only racks, lists
the GPU counts the planner chooses among. The GPUs used per domain of each shape are chosen by the search
(k3opt.search.frames.domain_options)."""

from __future__ import annotations

from k3opt.inputs.errors import SpecError
from k3opt.inputs.specs import ClusterSpec, Job, ModelSpec


def domain_block(used: int | None, domain_gpus: int) -> int:
    """GPUs a placement uses in each NVLink domain: `domain_gpus_used`, else (None) the whole domain."""
    return min(used or domain_gpus, domain_gpus)


def domains_held(gpus: int, used: int | None, domain_gpus: int) -> int:
    """NVLink domains (racks) a placement holds: ceil(gpus / GPUs used per domain)."""
    return -(-gpus // domain_block(used, domain_gpus))


def fill_sizes(model: ModelSpec, domain_gpus: int) -> list[int]:
    """GPUs per domain that a job given only racks is planned with: the whole domain, and for each rank block
    size b that fits a domain (a power of two: stages, shard groups; a divisor of the expert count: EP groups)
    the largest multiple of b a domain holds. K3 on NVL72: 72, 70 (EP7, EP14), 64 (EP16-64), 56 (EP28, EP56)."""
    blocks = {1 << k for k in range(domain_gpus.bit_length()) if 1 << k <= domain_gpus}
    if model.moe is not None:
        blocks |= {b for b in range(1, domain_gpus + 1) if model.moe.num_experts % b == 0}
    return sorted({domain_gpus // b * b for b in blocks}, reverse=True)


def resolve_placement(job: Job, model: ModelSpec, cluster: ClusterSpec) -> Job:
    """The job with its GPU counts set and checked: a pinned `domain_gpus_used` no larger than a domain; with
    `racks` and `gpus`, every GPU count within the racks; with `racks` alone, racks x each fill size (or the pinned
    size). Raises SpecError, one line, on a placement that cannot exist."""
    d = cluster.nvlink_domain_gpus
    if job.domain_gpus_used is not None and job.domain_gpus_used > d:
        raise SpecError(f"domain_gpus_used ({job.domain_gpus_used}) exceeds the {d}-GPU NVLink domain of "
                        f"{cluster.name}; use at most {d}")
    if job.racks is None:
        return job
    held = job.racks * d
    if job.gpus is None:
        sizes = [job.domain_gpus_used] if job.domain_gpus_used is not None else fill_sizes(model, d)
        return job.model_copy(update={"gpus": sorted(job.racks * u for u in sizes)})
    for g in job.gpu_counts:
        if g > held:
            raise SpecError(f"{g} GPUs do not fit in {job.racks} racks of {d} GPUs ({held}); raise racks to "
                            f"{domains_held(g, None, d)} or lower gpus")
        u = job.domain_gpus_used
        if u is not None and domains_held(g, u, d) > job.racks:
            raise SpecError(f"{g} GPUs at domain_gpus_used = {u} take {domains_held(g, u, d)} racks, more than "
                            f"racks = {job.racks}; raise racks or domain_gpus_used")
    return job
