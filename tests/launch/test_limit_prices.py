"""What each launch-target limit costs: the plan re-run with one limit lifted alone, checked against the same
job narrowed by hand through its [search] lists (the lifting mechanism against an explicit construction)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import k3opt
from k3opt.cli import main
from k3opt.inputs.specs import TOGGLE_NAMES, kda_layers
from k3opt.launch import NO_SWITCH, launch_refusals
from k3opt.planner import binding_limits, limit_prices

DATA = Path(__file__).parents[1] / "data"
TARGET = "megatron-bridge"
SPEC = {
    "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
    "context": 2048, "rows": 1, "tokens_per_update": 32768, "reserve_gib": 1.5,
    "search": {"pp": [2], "vp": [1, 2], "cp": [1, 2], "ep": [2, 4], "expert_fsdp": [1, 2],
               "dense_fsdp": [1, 2], "recompute": ["full"],
               "forbid_toggles": [t for t in TOGGLE_NAMES if t not in ("fused_situ", "fp8_activations")]},
}


@pytest.fixture(scope="module")
def tiny():
    return k3opt.load_model(DATA / "tiny-moe.toml"), k3opt.load_cluster(DATA / "slow-cluster.toml")


def _by_hand(lifted: str, model: k3opt.ModelSpec, cluster: k3opt.ClusterSpec) -> float:
    """The best runnable layout with every Megatron-Bridge limit but `lifted`, written as [search] lists and a
    filter on the derived expert sharding degree, without a target."""
    search = dict(SPEC["search"])
    if lifted != "vp":
        search["vp"] = [1]
    if lifted != "cp" and kda_layers(model):
        search["cp"] = [1]
    if lifted != "fsdp_lifecycle":
        search["fsdp_lifecycle"] = ["accumulate"]
    search["forbid_toggles"] = sorted(set(search["forbid_toggles"]) | {
        ns.toggle for ns in NO_SWITCH[TARGET] if f"toggle:{ns.toggle}" != lifted})
    res = k3opt.plan(k3opt.Job.model_validate({**SPEC, "search": search}), model=model, cluster=cluster, top=64,
                     gap=0.0)
    ok = [it for it in res.layouts if lifted == "expert_fsdp" or it.layout.dense_fsdp == it.layout.ep *
          it.layout.expert_fsdp]
    return ok[0].rank_time_s


def test_each_binding_limit_is_priced_as_the_plan_narrowed_by_hand_without_it(tiny):
    model, cluster = tiny
    free = k3opt.plan(k3opt.Job.model_validate(SPEC), model=model, cluster=cluster, top=1, gap=0.0)
    job = k3opt.Job.model_validate({**SPEC, "target": TARGET})
    bound = k3opt.plan(job, model=model, cluster=cluster, top=1, gap=0.0)
    binding = binding_limits(free.layouts[0].layout, TARGET, model)
    # the ids are those of the free best's refusals, each once
    assert len(binding) == len(launch_refusals(free.layouts[0].layout, TARGET, model)) >= 1
    prices = limit_prices(job, bound.layouts[0].rank_time_s, binding, model, cluster, gap=0.0)
    assert {p.limit for p in prices} == set(binding)
    for p in prices:
        assert p.best_s == pytest.approx(_by_hand(p.limit, model, cluster), rel=1e-12), p.limit
        assert p.saves_s == pytest.approx(bound.layouts[0].rank_time_s - p.best_s, rel=1e-12)
        # lifting a limit widens the search: never slower than with all of them, never faster than with none
        assert free.layouts[0].rank_time_s - 1e-9 <= p.best_s <= bound.layouts[0].rank_time_s + 1e-9
    assert [p.saves_s for p in prices] == sorted((p.saves_s for p in prices), reverse=True)


def test_every_row_names_the_targets_that_can_run_it(tiny):
    model, cluster = tiny
    free = k3opt.plan(k3opt.Job.model_validate(SPEC), model=model, cluster=cluster, top=3)
    bound = k3opt.plan(k3opt.Job.model_validate({**SPEC, "target": TARGET}), model=model, cluster=cluster, top=3)
    assert all(TARGET in it.runs_on for it in bound.layouts)
    # the free plan's best layouts include some Bridge refuses (test_launch: the unconstrained best breaks its rules)
    assert any(it.layout.vp > 1 or it.layout.toggles.fused_situ for it in free.layouts)
    for it in free.layouts:
        # a VP > 1 layout cannot run on Bridge's K3 spec; a layout with a toggle no framework has runs nowhere
        if it.layout.vp > 1 or it.layout.toggles.fused_situ:
            assert TARGET not in it.runs_on
    assert list(bound.to_frame("layouts")["runs_on"]) == [" ".join(it.runs_on) or "none" for it in bound.layouts]


def test_cli_plan_with_a_target_prints_and_reports_each_limit_price(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(
        f'model = "{DATA / "tiny-moe.toml"}"\ncluster = "{DATA / "slow-cluster.toml"}"\ngpus = 8\ncontext = 2048\n'
        'tokens_per_update = 32768\nreserve_gib = 1.5\n[search]\npp = [2]\nep = [2, 4]\nvp = [1, 2]\n'
        'recompute = ["full"]\n')
    res = CliRunner().invoke(main, ["plan", str(job), "--top", "1", "--target", TARGET, "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    prices = out["limit_prices"]
    assert prices and all({"limit", "text", "best_s", "saves_s"} <= set(p) for p in prices)
    assert out["layouts"][0]["layout"]["vp"] == 1
    res = CliRunner().invoke(main, ["plan", str(job), "--top", "1", "--target", TARGET])
    assert res.exit_code == 0, res.output
    assert "what each binding limit costs" in res.output
    for p in prices:
        assert p["limit"].removeprefix("toggle:") in res.output
    assert "runs_on" in res.output


def test_plan_with_a_target_keeps_every_search_inside_the_one_time_limit(tmp_path, monkeypatch):
    """`plan --target` runs the plan, the plan without the target's limits and one plan per binding limit. Each is
    given at most what is left of the command's limit when it starts, so none can end after it (the searches
    once took the whole limit each: a 12-s plan with six binding limits ran 99 s)."""
    import time

    import k3opt.cli as cli

    calls: list[tuple[float, float]] = []

    def recording(fn):  # noqa: ANN001, ANN202
        def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls.append((time.monotonic(), kwargs["time_limit"]))
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(cli, "run_plan", recording(cli.run_plan))
    monkeypatch.setattr(cli, "limit_price", recording(cli.limit_price))
    job = tmp_path / "job.toml"
    job.write_text(
        f'model = "{DATA / "tiny-moe.toml"}"\ncluster = "{DATA / "slow-cluster.toml"}"\ngpus = 8\ncontext = 2048\n'
        'tokens_per_update = 32768\nreserve_gib = 1.5\n[search]\npp = [2]\nep = [2, 4]\nvp = [1, 2]\n'
        'recompute = ["full"]\n')
    limit = 30.0
    t0 = time.monotonic()
    res = CliRunner().invoke(main, ["plan", str(job), "--top", "1", "--target", TARGET, "--json",
                                    "--time-limit", str(limit)])
    assert res.exit_code == 0, res.output
    assert len(calls) >= 3  # the plan, the plan without the limits, at least one limit price
    assert calls[0][1] == pytest.approx(limit / 2)  # the answer's share
    for start, given in calls:
        # the command sets its deadline once its job is read, a few milliseconds after t0
        assert start + given <= t0 + limit + 0.5


def test_a_limit_price_says_when_its_search_was_cut_or_not_run():
    cut = k3opt.planner.LimitPrice("vp", "vp limited in x", 10.0, 2.0, proven=False)
    assert cut.line() == "vp limited: at least -2.000 s per step lifted alone (search cut by the time limit) " \
                         "(vp limited in x)"
    none = k3opt.planner.LimitPrice("vp", "vp limited in x", None, None, proven=False)
    assert "found no runnable layout within its time" in none.line()
    skipped = k3opt.planner.LimitPrice("toggle:fused_situ", "t", None, None, proven=False, priced=False)
    assert skipped.line() == "fused_situ has no switch: not priced, the time limit was spent (raise --time-limit) (t)"
    assert k3opt.planner.LimitPrice("vp", "x", 10.0, 2.0).line() == "vp limited: -2.000 s per step lifted alone (x)"


def test_torchtitan_precision_limit_is_priced_as_the_job_narrowed_to_bf16_by_hand(tiny):
    """The tiny MoE model with BF16 and per-tensor FP8 accepted: without a target the fastest layout runs FP8 (the
    slow cluster's FP8 peak is twice its BF16); for torchtitan (row-wise FP8 grouped GEMMs) every ranked layout
    is BF16, and the precision limit lifted alone prices as the job with every other torchtitan limit kept and
    precisions = ["bf16", "fp8"] (the lifted search) against precisions = ["bf16"] (the bound one)."""
    model, cluster = tiny
    spec = {**SPEC, "precisions": ["bf16", "fp8"], "search": {**SPEC["search"], "vp": [1], "cp": [1]}}
    free = k3opt.plan(k3opt.Job.model_validate(spec), model=model, cluster=cluster, top=1, gap=0.0)
    assert free.layouts[0].layout.precision.value == "fp8"
    job = k3opt.Job.model_validate({**spec, "target": "torchtitan"})
    bound = k3opt.plan(job, model=model, cluster=cluster, top=8, gap=0.0)
    assert {it.layout.precision.value for it in bound.layouts} == {"bf16"}
    by_hand = k3opt.plan(k3opt.Job.model_validate({**spec, "target": "torchtitan", "precisions": ["bf16"]}),
                         model=model, cluster=cluster, top=1, gap=0.0)
    assert bound.layouts[0].rank_time_s == pytest.approx(by_hand.layouts[0].rank_time_s, rel=1e-12)
    assert "precision" in binding_limits(free.layouts[0].layout, "torchtitan", model)
    (price,) = limit_prices(job, bound.layouts[0].rank_time_s, ["precision"], model, cluster, gap=0.0)
    assert price.best_s < bound.layouts[0].rank_time_s
    assert price.best_s >= free.layouts[0].rank_time_s - 1e-9
