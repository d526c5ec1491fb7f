"""Pictures render to PNG files of sensible size; the timeline's schedule reproduces the 1F1B rules.

Expected values: 1F1B holds min(M, p - r) unfinished forwards on rank r (seed 000) and, with equal stage
times t, lasts (M + p - 1) t (seed 002's slot count); interleaving's warmup is 2(p - r - 1) + (v - 1) p
forwards (Megatron's get_pp_rank_microbatches), so the peak is that plus one.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.image as mpimg
import pytest
from click.testing import CliRunner

import k3opt
from k3opt.cli import main
from k3opt.inputs.errors import LayoutError
from k3opt.report.plots import in_flight_peak, ledger_plot, pareto_plot, pipeline_schedule, timeline_plot
from k3opt.search import PlanItem


def _check_png(path, min_w=600, min_h=350):  # noqa: ANN001
    assert path.stat().st_size > 20_000  # a blank canvas of this size is a few kB
    h, w = mpimg.imread(path).shape[:2]
    assert w >= min_w and h >= min_h
    return w, h


def test_ledger_plot(tmp_path, reference_eval):
    out = tmp_path / "ledger.png"
    ledger_plot(reference_eval, out)
    w, h = _check_png(out)
    assert w > h  # eight bars plus the legend: landscape


def test_timeline_plot_1f1b_and_interleaved(tmp_path, reference_eval, model, cluster):
    out = tmp_path / "timeline.png"
    timeline_plot(reference_eval, out)
    _check_png(out)
    lay = k3opt.make_layout(**{**reference_eval.layout.model_dump(), "vp": 2, "microbatches": 16,
                               "split": [6] * 15 + [3]})
    out2 = tmp_path / "timeline-vp2.png"
    timeline_plot(k3opt.evaluate(lay, model=model, cluster=cluster), out2)
    _check_png(out2)


def test_timeline_draws_the_replay_the_plan_is_ranked_by(reference_eval, model, cluster):
    """The chunks the timeline draws are those the ranked step replays: backward three times the forward (the
    reference recomputes fully: 2 + the replayed forward, SC21 section 3.5), each rank's chunks sharing its
    achievable stage time (the slowest rank's sum is the stage), and the replay of them ends at the ranked
    schedule time less the update and the unpaired all-to-all."""
    lay = k3opt.make_layout(**{**reference_eval.layout.model_dump(), "vp": 2, "microbatches": 16,
                               "split": [6] * 15 + [3]})
    st = k3opt.evaluate(lay, model=model, cluster=cluster).step
    p, v = lay.pp, lay.vp
    per = st.ranked_chunk_s
    assert len(per) == p * v
    assert lay.recompute == "full" and all(b == pytest.approx(3 * f, rel=1e-12) for f, b in per)
    assert max(sum(sum(per[r + k * p]) for k in range(v)) for r in range(p)) == pytest.approx(
        st.achievable_stage_time_s, rel=1e-12)
    ops = pipeline_schedule(p, v, lay.microbatches, [[per[r + k * p][0] for k in range(v)] for r in range(p)],
                            [[per[r + k * p][1] for k in range(v)] for r in range(p)])
    assert max(o.end for o in ops) == pytest.approx(
        st.ranked_schedule_time_s - st.achievable_update_time_s - st.achievable_unpaired_ep_s, rel=1e-9)


def test_timeline_plot_replays_the_ranked_chunks(tmp_path, reference_eval, monkeypatch):
    """timeline_plot hands pipeline_schedule each rank's chunks' forward and backward as StepTime.ranked_chunk_s
    holds them (global chunk g on rank g mod p), not layer counts."""
    import k3opt.report.plots as plots

    seen = {}
    real = plots.pipeline_schedule

    def spy(p, v, m, fwd, bwd=None):
        seen.update(p=p, v=v, fwd=fwd, bwd=bwd)
        return real(p, v, m, fwd, bwd)

    monkeypatch.setattr(plots, "pipeline_schedule", spy)
    plots.timeline_plot(reference_eval, tmp_path / "t.png")
    per, p = reference_eval.step.ranked_chunk_s, reference_eval.layout.pp
    assert seen["bwd"] is not None
    assert seen["fwd"] == [[per[r + k * p][0] for k in range(seen["v"])] for r in range(p)]
    assert seen["bwd"] == [[per[r + k * p][1] for k in range(seen["v"])] for r in range(p)]


def test_pareto_plot(tmp_path, reference, model, cluster):
    items = []
    for m, pp in ((64, 8), (32, 4)):
        split = [12] * 7 + [9] if pp == 8 else [24, 24, 24, 21]
        lay = k3opt.make_layout(**{**reference.model_dump(), "pp": pp, "split": split, "microbatches": m,
                                   "dense_fsdp": 64, "ep": 64, "measured": None})
        items.append(PlanItem(lay, k3opt.evaluate(lay, model=model, cluster=cluster)))
    out = tmp_path / "pareto.png"
    pareto_plot(items, out, best=items[0])
    _check_png(out, min_w=500)


@pytest.mark.parametrize("p,m", [(8, 64), (4, 3), (1, 5)])
def test_1f1b_schedule_in_flight_and_length(p, m):
    t = 0.3
    ops = pipeline_schedule(p, 1, m, [[t]] * p)
    assert [in_flight_peak(ops, r) for r in range(p)] == [min(m, p - r) for r in range(p)]
    assert max(o.end for o in ops) == pytest.approx((m + p - 1) * t)


def test_interleaved_schedule_peak_is_warmup_plus_one():
    p, v, m = 4, 2, 8
    ops = pipeline_schedule(p, v, m, [[1.0, 1.0]] * p)
    assert [in_flight_peak(ops, r) for r in range(p)] == [2 * (p - r - 1) + (v - 1) * p + 1 for r in range(p)]
    with pytest.raises(LayoutError, match="divisible"):
        pipeline_schedule(4, 2, 6, [[1.0, 1.0]] * 4)


def test_cli_explain_plot_and_timeline(tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    res = CliRunner().invoke(main, ["explain", "k3-gb200-512-reference", "--plot", str(a), "--timeline", str(b)])
    assert res.exit_code == 0, res.output
    _check_png(a)
    _check_png(b)


def test_cli_picture_must_be_png(tmp_path):
    res = CliRunner().invoke(main, ["explain", "k3-gb200-512-reference", "--plot", str(tmp_path / "a.jpg")])
    assert res.exit_code == 2 and "PNG" in res.output


def test_cli_pareto_plot(tmp_path):
    data = Path(__file__).parents[1] / "data"
    job = tmp_path / "job.toml"
    job.write_text(
        f'model = "{data / "tiny-moe.toml"}"\ncluster = "{data / "slow-cluster.toml"}"\ngpus = [4, 8]\n'
        'context = 2048\ntokens_per_update = 32768\nreserve_gib = 1.5\n[search]\npp = [2]\nep = [2]\nvp = [1]\n'
        'expert_fsdp = [1]\nrecompute = ["full"]\n')
    out = tmp_path / "pareto.png"
    res = CliRunner().invoke(main, ["pareto", str(job), "--plot", str(out)])
    assert res.exit_code == 0, res.output
    _check_png(out, min_w=500)
