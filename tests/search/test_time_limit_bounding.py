"""The time limit stops the shapes' first bounds: a job of tens of thousands of shapes (Kimi K2 on 16 racks, every
GPUs-per-rack size: 48,615) took 14 s to bound under a 6-s limit, because only Ctrl-C (or the front's share) cut
that phase."""

from __future__ import annotations

import time

import pytest

import k3opt
from k3opt.search.driver import _Search  # noqa: PLC2701


def _search(job: k3opt.Job, pareto: bool = False) -> _Search:
    return _Search(job, None, None, top=1, time_limit=60.0, workers=1, pareto=pareto, pareto_step_gib=1.0,
                   progress=None, gap=0.01)


def test_bounding_stops_at_the_deadline_and_leaves_the_bound_open():
    s = _search(k3opt.load_job("k3-512-4k"))
    s.first_pass()
    assert s.best_of  # the first pass found a layout on the default job
    s.deadline = time.monotonic() - 1.0  # the limit has passed
    s.bound_shapes()
    assert s.shapes_bounded == 0 and s.timed_out and s.unbounded


def test_a_plan_past_its_limit_without_a_layout_raises_the_timeout_error():
    s = _search(k3opt.load_job("k3-512-4k"))
    s.deadline = time.monotonic() - 1.0
    s.bound_shapes()  # before any layout
    assert s.shapes_bounded == 0 and s.timed_out
    s.start_helper()
    s.run()
    with pytest.raises(k3opt.SearchTimeoutError, match="no layout found within the 60 s time limit"):
        s.finish()


def test_the_first_pass_has_its_share_however_long_the_set_up_took():
    """Listing 48,615 shapes and bounding the pipeline heads took the whole heuristic budget counted from the
    search's start, so the first pass priced nothing and the first layout waited for every shape's bounds. Its
    share now counts from its own start: with the start pushed 100 s back (the limit still ahead), the default
    job's first pass still finds a layout."""
    s = _search(k3opt.load_job("k3-512-4k"))
    s.t0 -= 100.0
    s.deadline = time.monotonic() + 60.0
    s.first_pass()
    assert s.best_of


def test_a_node_solve_stops_at_the_search_deadline_however_long_its_model_took(monkeypatch):
    """A node's slice was handed to CP-SAT whole after its model was built: on K3 over 1,024 B200 GPUs a PP32 VP2
    node's model (7,072 variables) took seconds to build, and a 60-s plan ended at 68 s. Past the deadline a solve
    gets only the least time (enough to check a hint); before it, its slice, cut to what is left."""
    from k3opt.search import node_model

    job = k3opt.load_job("k3-512-4k")
    model, cluster = k3opt.load_model("kimi-k3-4layer-proxy"), k3opt.load_cluster(job.cluster)
    job = job.model_copy(update={"gpus": 8, "tokens_per_update": 8 * 4096 * 4, "model": "kimi-k3-4layer-proxy",
                                 "domain_gpus_used": None})
    from k3opt.search import enumerate_frames

    f = next(f for f in enumerate_frames(job, model, 8, cluster) if f.vp == 1)
    limits: list[float] = []
    real = node_model.FrameModel.solve

    def solve(self, time_limit, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        limits.append(time_limit)
        return real(self, time_limit, *args, **kwargs)

    monkeypatch.setattr(node_model.FrameModel, "solve", solve)
    node_model.solve_frame(job, f, model, cluster, 30.0, recompute=k3opt.inputs.specs.Recompute.FULL,
                           lifecycle=k3opt.inputs.specs.FsdpLifecycle.PER_MICROBATCH,
                           deadline=time.monotonic() - 1.0)
    assert limits == [node_model.POLICY.min_solve_s]
    limits.clear()
    node_model.solve_frame(job, f, model, cluster, 30.0, recompute=k3opt.inputs.specs.Recompute.FULL,
                           lifecycle=k3opt.inputs.specs.FsdpLifecycle.PER_MICROBATCH,
                           deadline=time.monotonic() + 5.0)
    assert len(limits) == 1 and node_model.POLICY.min_solve_s < limits[0] <= 5.0
