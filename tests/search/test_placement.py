"""Placement as a decision: the GPUs used per NVLink domain each shape is searched under
(search/frames.domain_options), the racks a job may hold, and the search's choice against exhaustive enumeration
on the small model over a cluster whose 6-GPU domains do not tile 8 GPUs evenly."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from conftest import contiguous_splits

import k3opt
from k3opt.inputs.errors import SpecError
from k3opt.inputs.placement import domains_held, resolve_placement
from k3opt.inputs.presets import make_layout
from k3opt.inputs.specs import FsdpLifecycle, Job, Recompute
from k3opt.search import enumerate_frames
from k3opt.search.frames import domain_options

DATA = Path(__file__).parents[1] / "data"
TOL_S = 1e-4


def _job(**kw) -> Job:
    return Job(tokens_per_update=16_777_216, **{"gpus": 512, **kw})


@pytest.mark.parametrize(("gpus", "p", "c", "e", "fe", "fd", "domain", "want"), [
    # Stage 64 = one EP64 group: whole racks (72) put stage 1 on ranks 64-127, across racks 0 and 1; 64 per rack
    # aligns every stage to a rack. Both hold ceil(512 / 72) = ceil(512 / 64) = 8 racks: both searched.
    (512, 8, 1, 64, 1, 64, 72, (None, 64)),
    # Stage 72 on 576 = 8 x 72 GPUs: whole racks already align every block (EP8 blocks tile 72).
    (576, 8, 1, 8, 1, 72, 72, (None,)),
    # HGX 8-GPU domains: every size that tiles a block is the whole domain.
    (512, 8, 1, 8, 1, 64, 8, (None,)),
    # 8 GPUs in one 72-GPU domain: 8 per domain prices as whole domains (every group inside one domain), and of
    # sizes that price alike the one with fewer racks, then the fuller, is kept.
    (8, 1, 1, 8, 1, 8, 72, (None,)),
    # Stage 144 (over a domain): EP16 gives 72 // 16 x 16 = 64 (EP groups whole, dense 36s split), the expert
    # shard group EP16 x 3 gives 48 (EP, its shard triples and the dense 36s' halves local), dense 36 gives 72.
    # Whole racks split EP16 groups (64-79 across 72). Three placements, three prices.
    (576, 4, 1, 16, 3, 36, 72, (None, 64, 48)),
    # The dense shard group 48 alone gives 48: whole racks split it (48-95 across 72), 48 per rack does not.
    (576, 4, 1, 8, 1, 48, 72, (None, 48)),
    # 140 GPUs hold 2 racks at the fewest, evenly filled with 70 each: no block gives 70 (EP4 and dense 4 give 72),
    # and 70 splits the EP4 group 68-71, so it prices apart from whole racks.
    (140, 1, 1, 4, 1, 4, 72, (None, 70)),
])
def test_domain_options_by_hand(gpus, p, c, e, fe, fd, domain, want) -> None:
    assert domain_options(_job(gpus=gpus), gpus, p, c, e, fe, fd, domain) == want


def test_racks_bound_the_options_and_a_pin_wins() -> None:
    # 2,048 GPUs: whole racks hold ceil(2048 / 72) = 29; 64 per rack needs 32.
    assert domain_options(_job(gpus=2048), 2048, 16, 1, 64, 1, 128, 72) == (None, 64)
    assert domain_options(_job(gpus=2048, racks=29), 2048, 16, 1, 64, 1, 128, 72) == (None,)
    assert domain_options(_job(gpus=2048, racks=32), 2048, 16, 1, 64, 1, 128, 72) == (None, 64)
    assert domain_options(_job(domain_gpus_used=32), 512, 8, 1, 64, 1, 64, 72) == (32,)
    assert (domains_held(2048, None, 72), domains_held(2048, 64, 72), domains_held(512, 64, 72)) == (29, 32, 8)


def test_a_2048_gpu_job_searches_both_placements() -> None:
    model, cluster = k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")
    job = _job(gpus=2048, search={"pp": [8], "vp": [4], "ep": [64]})
    assert {f.domain_gpus_used for f in enumerate_frames(job, model, 2048, cluster)} == {None, 64}


def test_a_placement_at_its_limit_is_accepted() -> None:
    """The limits are inclusive: a whole 72-GPU domain pinned, 576 GPUs in 8 racks of 72, 512 GPUs at 64 per rack
    in exactly 8 racks."""
    model, cluster = k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")
    assert resolve_placement(_job(domain_gpus_used=72), model, cluster).domain_gpus_used == 72
    assert resolve_placement(_job(gpus=576, racks=8), model, cluster).gpu_counts == [576]
    assert resolve_placement(_job(racks=8, domain_gpus_used=64), model, cluster).gpu_counts == [512]


def test_racks_alone_choose_the_gpu_count() -> None:
    cluster = k3opt.load_cluster("gb200-nvl72")
    # 8 racks: whole racks (8 x 72 = 576) and each size that tiles an EP block of K3's 896 experts on a 72-GPU
    # rack: 64 (EP16/32/64), 56 (EP28/56) and 70 (EP7/14): 448, 512, 560, 576 GPUs.
    got = resolve_placement(Job(racks=8, tokens_per_update=16_777_216), k3opt.load_model("kimi-k3"), cluster)
    assert got.gpu_counts == [448, 512, 560, 576]
    pinned = resolve_placement(Job(racks=8, domain_gpus_used=64, tokens_per_update=16_777_216),
                               k3opt.load_model("kimi-k3"), cluster)
    assert pinned.gpu_counts == [512]


@pytest.mark.parametrize(("fields", "message"), [
    ({"gpus": 2048, "racks": 28}, "2048 GPUs do not fit in 28 racks of 72 GPUs (2016); raise racks to 29"),
    ({"gpus": 512, "domain_gpus_used": 80}, "domain_gpus_used (80) exceeds the 72-GPU NVLink domain"),
])
def test_placement_that_cannot_exist_is_one_clear_error(fields, message) -> None:
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_placement(Job(tokens_per_update=16_777_216, **fields), k3opt.load_model("kimi-k3"),
                          k3opt.load_cluster("gb200-nvl72"))


# ---------------------------------------------------------------------------------------- enumeration

ALLOWED = ("fp8_activations",)


@pytest.fixture
def six(slow):
    """The slow test cluster with 6-GPU NVLink domains (8 GPUs take 2 domains either as 6 + 2 or as 4 + 4) and a
    NIC 40x slower, so that traffic across domains is not hidden behind the tiny model's compute."""
    return slow.model_copy(update={"name": "slow-six", "nvlink_domain_gpus": 6, "nic_gbps": 0.05})


@pytest.fixture(scope="module")
def placement_job():
    return Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 1.5,
        "search": {"pp": [2], "vp": [1], "cp": [1], "ep": [4], "expert_fsdp": [1], "dense_fsdp": [1, 2, 4],
                   "recompute": ["none", "full"], "fsdp_lifecycle": ["per_microbatch"],
                   "forbid_toggles": [t for t in k3opt.inputs.specs.TOGGLE_NAMES if t not in ALLOWED]},
    })



def test_search_chooses_the_placement_enumeration_does(placement_job, tiny, six):
    frames = enumerate_frames(placement_job, tiny, 8, six)
    assert {f.domain_gpus_used for f in frames} == {None, 4}  # 6 + 2 (whole domains) or 4 + 4
    best: dict[int | None, float] = {}
    for f in frames:
        for rc, flags in itertools.product((Recompute.NONE, Recompute.FULL), [(False,), (True,)]):
            for split in contiguous_splits(tiny.num_layers, f.pp * f.vp):
                lay = make_layout(gpus=8, pp=f.pp, vp=f.vp, cp=f.cp, ep=f.ep, expert_fsdp=f.expert_fsdp,
                                  dense_fsdp=f.dense_fsdp, microbatches=f.microbatches, rows=1, context=2048,
                                  split=split, recompute=rc, fsdp_lifecycle=FsdpLifecycle.PER_MICROBATCH,
                                  toggles=dict(zip(ALLOWED, flags, strict=True)), reserve_gib=1.5,
                                  dense_sharding=f.dense_sharding, expert_sharding=f.expert_sharding,
                                  grad_dtype=f.grad_dtype, precision=f.precision,
                                  domain_gpus_used=f.domain_gpus_used)
                ev = k3opt.evaluate(lay, model=tiny, cluster=six)
                if ev.fits:
                    u = f.domain_gpus_used
                    best[u] = min(best.get(u, float("inf")), ev.step.rank_time_s)
    # Both placements have fitting layouts and they price differently, so the choice matters here.
    assert set(best) == {None, 4} and abs(best[None] - best[4]) > 10 * TOL_S
    plan = k3opt.plan(placement_job, model=tiny, cluster=six, top=1, gap=0)
    assert plan.status == "OPTIMAL"
    want_u = min(best, key=best.get)
    assert plan.layouts[0].rank_time_s == pytest.approx(best[want_u], abs=TOL_S)
    assert plan.layouts[0].layout.domain_gpus_used == want_u


def test_cli_plan_prints_the_placement_and_why(tmp_path, placement_job):
    """On 6-GPU domains with a slow NIC the plan reports 2 racks x 4 GPUs (8 used, 12 held, 4 idle) and, against
    whole domains (6 + 2, also 2 racks), the slower best it found there; --json carries the same choices."""
    import json

    from click.testing import CliRunner

    from k3opt.cli import main

    job = _job_file(tmp_path, placement_job, "six", domain=6, nic_gbps=0.05)
    out = CliRunner().invoke(main, ["plan", str(job), "--top", "1", "--gap", "0"])
    assert out.exit_code == 0, out.output
    text = out.output
    assert "placement: 2 racks x 4 of 6 GPUs (8 GPUs used, 12 held, 4 idle)" in text
    why = [ln for ln in text.splitlines() if ln.startswith("  over whole racks (6 per rack), 2 racks: ")]
    # Either the best layout found under whole racks, slower, or (never priced) its shapes' least bound.
    assert len(why) == 1 and ("best found" in why[0] and "(+" in why[0] or "no layout found, bound" in why[0])
    res = json.loads(CliRunner().invoke(main, ["plan", str(job), "--top", "1", "--gap", "0", "--json"]).output)
    assert [o["domain_gpus_used"] for o in res["placements"]] == [4, None]
    whole = res["placements"][1]
    assert whole["best_s"] is None or res["placements"][0]["best_s"] < whole["best_s"]
    assert res["layouts"][0]["placement"] == {**res["layouts"][0]["placement"], "gpus_per_domain": 4,
                                              "domains_held": 2, "gpus_held": 12, "gpus_used": 8}


def test_cli_plan_names_one_rack_in_the_singular(tmp_path, placement_job):
    """Eight GPUs in one 8-GPU domain: the placement line reads "1 rack x 8 of 8 GPUs", not "1 racks"."""

    from click.testing import CliRunner

    from k3opt.cli import main

    job = _job_file(tmp_path, placement_job, "eight", domain=8)
    out = CliRunner().invoke(main, ["plan", str(job), "--top", "1", "--gap", "0"])
    assert out.exit_code == 0, out.output
    assert "placement: 1 rack x 8 of 8 GPUs (8 GPUs used, 8 held, 0 idle)" in out.output, out.output


def test_a_part_filled_last_rack_is_named():
    """100 GPUs over 8-GPU domains hold 13 racks, 12 full and one with 4 GPUs (12 x 8 + 4 = 100); whole 6-GPU racks
    for 8 GPUs are one of 6 and one of 2."""
    from k3opt.report.text import _racks_text

    assert _racks_text(13, 8, 100) == "12 racks x 8 and 1 rack x 4"
    assert _racks_text(2, 6, 8) == "1 rack x 6 and 1 rack x 2"
    assert _racks_text(8, 64, 512) == "8 racks x 64" and _racks_text(1, 8, 8) == "1 rack x 8"
    assert _racks_text(2, 4, 8) == "2 racks x 4"


def _job_file(tmp_path: Path, job: Job, name: str, domain: int, nic_gbps: float | None = None) -> Path:
    """`job` as a TOML file on tests/data/slow-cluster.toml with `domain`-GPU NVLink domains (and its NIC at
    `nic_gbps`), as `k3opt plan` reads it."""
    import json

    text = (DATA / "slow-cluster.toml").read_text().replace('name = "slow-test"', f'name = "slow-{name}"')
    text = text.replace("nvlink_domain_gpus = 4", f"nvlink_domain_gpus = {domain}")
    if nic_gbps is not None:
        text = text.replace("nic_gbps = 2", f"nic_gbps = {nic_gbps}")
    cluster = tmp_path / f"{name}.toml"
    cluster.write_text(text)
    data = job.model_dump(mode="json", exclude_none=True)
    data["cluster"] = str(cluster)
    search = data.pop("search")
    lines = [f"{k} = {json.dumps(v)}" for k, v in data.items() if not isinstance(v, dict)]
    lines += ["[search]"] + [f"{k} = {json.dumps(v)}" for k, v in search.items() if v not in (None, [])]
    path = tmp_path / "job.toml"
    path.write_text("\n".join(lines) + "\n")
    return path
