"""Throughput validation rows: one measured layout per expressible public row, each with its source, and the
`k3opt validate-throughput` table. The measured figures are typed in the layouts from the public table; the
tests check the plumbing and the arithmetic, not a tuned error."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import k3opt
from k3opt.cli import main
from k3opt.inputs.presets import load_layout
from k3opt.report.throughput import NOT_EXPRESSIBLE, measured_layouts, validate_throughput

# The rows of the public table (Megatron-Bridge docs/performance-summary.md at 067f987d): id -> TPS/GPU. The MB rows
# are the validation set's; the twelve after them are public rows of the same table beside it (26.04.01, 26.04 for
# the DeepSeek-V3 PP16 B200 run, 26.08 for the six GB200 and GB300 runs with the paged stash).
PUBLIC_ROWS = {"MB-1": 5248, "MB-2": 4224, "MB-12": 4992, "MB-13": 4256, "MB-14": 3328, "MB-17": 6944,
               "MB-18": 5680, "MB-20": 26112, "MB-21": 5328, "MB-22": 3139, "MB-23": 4018,
               "deepseek-v3-b200-mxfp8-pp16": 2815, "llama3-70b-gb300-mxfp8": 4864,
               "qwen3-235b-a22b-b200-mxfp8": 3776, "qwen3-30b-a3b-b200-mxfp8": 27136,
               "qwen3-30b-a3b-gb300-mxfp8": 31744, "qwen3-30b-a3b-h100-fp8": 8960,
               "deepseek-v3-gb200-mxfp8-paged-stash": 4912, "deepseek-v3-gb300-mxfp8-paged-stash": 6288,
               "qwen3-235b-a22b-gb200-mxfp8-paged-stash": 7280, "qwen3-235b-a22b-gb300-mxfp8-paged-stash": 8816,
               "qwen3-30b-a3b-gb200-mxfp8-paged-stash": 39936, "qwen3-30b-a3b-gb300-mxfp8-paged-stash": 44544}
BESIDE = ["deepseek-v3-b200-mxfp8-pp16", "deepseek-v3-gb200-mxfp8-paged-stash", "deepseek-v3-gb300-mxfp8-paged-stash",
          "llama3-70b-gb300-mxfp8", "qwen3-235b-a22b-b200-mxfp8", "qwen3-235b-a22b-gb200-mxfp8-paged-stash",
          "qwen3-235b-a22b-gb300-mxfp8-paged-stash", "qwen3-30b-a3b-b200-mxfp8",
          "qwen3-30b-a3b-gb200-mxfp8-paged-stash", "qwen3-30b-a3b-gb300-mxfp8", "qwen3-30b-a3b-gb300-mxfp8-paged-stash",
          "qwen3-30b-a3b-h100-fp8"]


@pytest.fixture(scope="module")
def validation():
    return validate_throughput()


def test_every_public_row_is_a_layout_or_named_as_not_expressible():
    names = {load_layout(p).name for p in measured_layouts()}
    assert names | set(NOT_EXPRESSIBLE) == set(PUBLIC_ROWS)
    assert not names & set(NOT_EXPRESSIBLE)


def test_layouts_carry_their_source_and_the_table_figure():
    for p in measured_layouts():
        lay = load_layout(p)
        # Settings from a pinned Megatron-Bridge commit: the perf recipes of 067f987d, or the performance configs of
        # v0.4.2 (c8101293), the release whose docs/performance-summary.md table is the 26.04.01 one, or of v0.2.1
        # (1c43b392), whose table is the 25.11 one (MB-22).
        assert ("Megatron-Bridge@067f987df03b8355b03192d88d70f1709fedf51a" in lay.source
                or "Megatron-Bridge@v0.4.2 (c810129341a84e58f4cbed3093f70668a088c028)" in lay.source
                or ("Megatron-Bridge@v0.2.1 (1c43b39285a4605799ca0ab5a69fe2f254802e18)" in lay.source
                    and lay.name == "MB-22")), lay.name
        assert lay.measured.tokens_per_s_per_gpu == PUBLIC_ROWS[lay.name]
        # Step time = GBS x seq / (TPS x GPUs) with GBS = DP x M x MBS.
        gbs = lay.dp * lay.microbatches * lay.rows
        assert lay.measured.step_time_s == pytest.approx(gbs * lay.context / (PUBLIC_ROWS[lay.name] * lay.gpus),
                                                         abs=1e-4)


def test_errors_and_mean_absolute_error_are_the_stated_arithmetic(validation):
    for r in validation.rows:
        assert r.error_pct == pytest.approx(100 * (r.predicted_tps_per_gpu - r.measured_tps_per_gpu)
                                            / r.measured_tps_per_gpu)
        # The achievable ceilings are at most the peaks, so the achievable prediction never beats the bound.
        assert r.predicted_tps_per_gpu <= r.roofline_tps_per_gpu * (1 + 1e-9)
    errs = [abs(r.error_pct) for r in validation.rows]
    assert validation.mean_abs_error_pct == pytest.approx(sum(errs) / len(errs))


def test_cli_prints_every_row_and_the_mae(validation):
    result = CliRunner().invoke(main, ["validate-throughput"])
    assert result.exit_code == 0, result.output
    for r in validation.rows:
        assert f"| {r.id} |" in result.output
    assert f"Mean absolute error (achievable): {validation.mean_abs_error_pct:.1f}%" in result.output
    data = json.loads(CliRunner().invoke(main, ["validate-throughput", "--json"]).output)
    assert len(data["rows"]) == len(validation.rows)


def test_26_04_01_rows_run_without_ep_overlap_as_their_release_did():
    """The 26.04.01 table's Qwen3 and GB200 / GB300 DeepSeek-V3 rows ran the performance configs of Megatron-Bridge
    v0.4.2, where moe_a2a_overlap = False (scripts/performance/configs/*/..._workload_base_configs.py, the
    WorkloadBaseConfig default in scripts/performance/utils/utils.py): their layouts keep the all-to-all exposed.
    MB-14 (B200) ran DeepEP with moe_a2a_overlap = True in the same release, and keeps the overlap."""
    by_name = {load_layout(p).name: load_layout(p) for p in measured_layouts()}
    for name in ("MB-12", "MB-13", "MB-17", "MB-18", "MB-20"):
        assert "v0.4.2" in by_name[name].source and not by_name[name].ep_overlap, name
    assert by_name["MB-14"].ep_overlap and by_name["MB-14"].dispatcher == "deepep"


def test_model_flops_per_token_match_the_runs_own_count(validation):
    """The published TFLOP/s/GPU / TPS/GPU is Megatron's FLOPs per token for that run: the structure of each new
    family (GQA, MLA, MoE with shared experts, MTP) reproduces it within 1% on every row; the 25.11 BF16 row (MB-22,
    "DeepSeekV3 (w/o MTP)" in its table) only with its layout's mtp_layers = 0 (with the MTP layer: 4.4% more)."""
    for r in validation.rows:
        rel = r.flops_per_token / r.measured_flops_per_token - 1
        if r.id == "qwen3-30b-a3b-b200-mxfp8":
            # The table's own figures disagree for this model and sequence: 619 TFLOP/s / 27,136 tokens/s on B200 is
            # 22.81 GFLOP a token, 599 / 26,112 on GB200 (MB-20) 22.94, 0.6% apart, beyond the rounding of the
            # TFLOP/s column (0.5 / 599 = 0.08%). Against the GB200 run's count it is within 1% as every row.
            mb20 = 599e12 / 26112
            assert abs(r.measured_flops_per_token / mb20 - 1) > 0.005
            rel = r.flops_per_token / mb20 - 1
        assert abs(rel) < 0.01, (r.id, rel)


def test_stage_gap_is_what_the_measured_step_leaves_beyond_the_stage(validation):
    """MB-20 runs PP 1 with 16 microbatches (GBS 512 / (DP 8 x MBS 4)), so its step is 16 stage-microbatches plus
    the update and the unpaired all-to-all: the GAP per stage-microbatch is (10.0392 s measured - update -
    unpaired) / 16 - stage, and the 48 layers sit on one rank. The prediction is optimistic there, so it is
    positive."""
    from k3opt import evaluate

    row = next(r for r in validation.rows if r.id == "MB-20")
    st = evaluate(load_layout("mb-20-qwen3-30b-a3b-gb200")).step
    unpaired = st.achievable_unpaired_ep_s
    assert st.achievable_step_time_s == pytest.approx(16 * st.achievable_stage_time_s + st.achievable_update_time_s
                                                      + unpaired)
    want = ((512 * 4096 / (26112 * 8) - st.achievable_update_time_s - unpaired) / 16 - st.achievable_stage_time_s) * 1e3
    assert row.stage_gap_ms == pytest.approx(want) and row.stage_gap_ms > 0 and row.error_pct > 0
    assert row.layers_per_rank == 48
    out = CliRunner().invoke(main, ["validate-throughput"]).output
    assert "GAP per stage-microbatch" in out and f"GAP {row.stage_gap_ms:+8.1f} ms" in out


# The validation rows evaluate() gives a measured layout: the step time, and the tokens/s per GPU at the peak and at the
# achievable rates.

def test_throughput_rows_at_the_peak_and_at_the_achievable_rates():
    lay = k3opt.load_layout("layouts/measured/mb-20-qwen3-30b-a3b-gb200.toml")
    ev = k3opt.evaluate(lay)
    rows = [(c.figure, c.unit, c.measured) for c in ev.validation]
    m = lay.measured.tokens_per_s_per_gpu
    assert rows == [("step time", "s", lay.measured.step_time_s), ("tokens/s per GPU", "tokens/s", m),
                    ("tokens/s per GPU at achievable rates", "tokens/s", m)]
    assert ev.validation[2].modeled == ev.step.achievable_tokens_per_s_per_gpu


def _layouts_by_name() -> dict[str, k3opt.Layout]:
    return {load_layout(p).name: load_layout(p) for p in measured_layouts()}


def test_rows_come_in_the_public_tables_order():
    """By row number, not by file name (MB-2 before MB-12)."""
    ids = [r.id for r in validate_throughput().rows]
    assert ids == ["MB-1", "MB-2", "MB-12", "MB-13", "MB-14", "MB-17", "MB-18", "MB-20", "MB-21", "MB-22", *BESIDE]


def test_each_row_reports_its_layout_and_the_stated_arithmetic(validation):
    """Each row's fields from its layout and evaluate(): the roofline error as the achievable one, the stage in ms,
    L / PP decoder layers a rank; the roofline MAE is the mean of the rows' absolute roofline errors."""
    by_name = _layouts_by_name()
    for r in validation.rows:
        lay = by_name[r.id]
        ev = k3opt.evaluate(lay)
        roof = ev.step.tokens_per_s_per_gpu
        assert (r.model, r.cluster, r.gpus, r.precision, r.source) == (lay.model, lay.cluster, lay.gpus,
                                                                       lay.precision.value, lay.source)
        assert r.binding == ev.step.achievable_binding
        assert r.roofline_tps_per_gpu == roof
        assert r.roofline_error_pct == pytest.approx(100 * (roof - PUBLIC_ROWS[r.id]) / PUBLIC_ROWS[r.id])
        assert r.stage_ms == pytest.approx(1e3 * ev.step.achievable_stage_time_s)
        assert r.layers_per_rank == pytest.approx(ev.model.num_layers / lay.pp)
    assert validation.roofline_mean_abs_error_pct == pytest.approx(
        sum(abs(r.roofline_error_pct) for r in validation.rows) / len(validation.rows))
    shown = {r.id: r.cuda_graphs for r in validation.rows}
    assert shown["MB-1"] == "none"
    assert shown["MB-13"] == "transformer_engine[attn,moe_router,moe_preprocess]"
    # DeepSeek-V3's 61 decoder layers over MB-14's 8 pipeline ranks
    assert next(r for r in validation.rows if r.id == "MB-14").layers_per_rank == 61 / 8


def test_the_stage_gap_leaves_out_the_unpaired_all_to_all(validation):
    """MB-14 runs the EP overlap, whose first forward and last backward expose their all-to-all: the GAP per
    stage-microbatch is (GBS x seq / (TPS x GPUs) - update - unpaired) / slots - stage."""
    lay = _layouts_by_name()["MB-14"]
    st = k3opt.evaluate(lay).step
    assert st.achievable_unpaired_ep_s > 0
    measured_step = lay.dp * lay.microbatches * lay.rows * lay.context / (PUBLIC_ROWS["MB-14"] * lay.gpus)
    want = 1e3 * ((measured_step - st.achievable_update_time_s - st.achievable_unpaired_ep_s) / st.slots
                  - st.achievable_stage_time_s)
    assert next(r for r in validation.rows if r.id == "MB-14").stage_gap_ms == pytest.approx(want)


def test_a_folder_of_ones_own_measured_layouts(tmp_path):
    """`validate --folder DIR` reads that folder only; an empty one is one clear error."""
    import shutil

    src = next(p for p in measured_layouts() if load_layout(p).name == "MB-20")
    shutil.copy(src, tmp_path / src.name)
    assert [r.id for r in validate_throughput(tmp_path).rows] == ["MB-20"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(k3opt.K3optError, match="no measured layouts with tokens_per_s_per_gpu found"):
        validate_throughput(empty)


def test_docs_show_the_table_the_cli_prints():
    """docs/validation.md carries `k3opt validate-throughput`'s rows, its mean absolute error and its GAP lines as
    the command prints them: the formatting is the documented one, and the documentation is current."""
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "validation.md").read_text()
    out = CliRunner().invoke(main, ["validate-throughput"]).output.splitlines()
    shown = [ln for ln in out if ln.startswith(("| MB-", "Mean absolute error", "  MB-",
                                                 *(f"| {b} |" for b in BESIDE), *(f"  {b} " for b in BESIDE)))]
    rows = len(PUBLIC_ROWS) - len(NOT_EXPRESSIBLE)
    assert len(shown) == 2 * rows + 1  # each expressible row, its GAP line, and the MAE line
    assert [ln for ln in shown if ln not in doc] == []
    data = json.loads(CliRunner().invoke(main, ["validate-throughput", "--json"]).output)
    assert set(data) == {"rows", "mean_abs_error_pct", "max_abs_error_pct", "roofline_mean_abs_error_pct",
                         "not_expressible"}
    assert data["not_expressible"] == NOT_EXPRESSIBLE and data["rows"][0]["id"] == "MB-1"
