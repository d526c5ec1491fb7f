"""A layout's `mtp_layers`: training without the MTP module the model was published with (Megatron
--mtp-num-layers), as the 25.11 DeepSeek-V3 rows of the Megatron-Bridge table ran ("DeepSeekV3 (w/o MTP)")."""

from __future__ import annotations

import pytest

import k3opt


def _mb22(**fields: object) -> k3opt.Layout:
    lay = k3opt.load_layout("mb-22-deepseek-v3-gb200")
    return k3opt.Layout.model_validate({**lay.model_dump(), **fields})


def test_without_mtp_the_model_is_the_published_main_model():
    """deepseek-ai/DeepSeek-V3 README_WEIGHTS.md: 671B main model weights, 11.5B MTP module weights (unique)."""
    with_mtp = k3opt.evaluate(_mb22(mtp_layers=None)).params.total
    without = k3opt.evaluate(_mb22(mtp_layers=0)).params.total
    assert without == pytest.approx(671e9, rel=1e-3)
    assert with_mtp - without == pytest.approx(11.5e9, rel=0.02)


def test_without_mtp_the_flops_per_token_are_the_runs_own():
    """MB-22's table: 782 TFLOP/s per GPU at 3,139 tokens/s per GPU = 249.1 GFLOP a token, counted without MTP;
    with the MTP layer k3opt counts 4.4% more, without it within 1%."""
    run = 782e12 / 3139
    assert k3opt.evaluate(_mb22(mtp_layers=None)).step.model_flops_per_token / run - 1 > 0.04
    assert k3opt.evaluate(_mb22(mtp_layers=0)).step.model_flops_per_token == pytest.approx(run, rel=0.01)


def test_exports_write_the_mtp_layers_trained():
    """Megatron trains no MTP unless --mtp-num-layers says (its default is None): DeepSeek-V3's export writes 1 and
    places it before the loss ('m'); with mtp_layers = 0 it writes 0 and the layout string holds no 'm'. Kimi K3 has
    no MTP: nothing is written."""
    with_mtp = dict(k3opt.to_launch(_mb22(mtp_layers=None), "megatron-lm").settings)
    assert with_mtp["--mtp-num-layers"] == "1" and with_mtp["--pipeline-model-parallel-layout"].endswith("|tmL")
    without = dict(k3opt.to_launch(_mb22(mtp_layers=0), "megatron-lm").settings)
    assert without["--mtp-num-layers"] == "0" and without["--pipeline-model-parallel-layout"].endswith("|tL")
    bridge = dict(k3opt.to_launch(_mb22(mtp_layers=0), "megatron-bridge").settings)
    assert bridge["model.mtp_num_layers"] == "0"
    k3 = dict(k3opt.to_launch(k3opt.load_layout("k3-gb200-512-reference"), "megatron-lm").settings)
    assert "--mtp-num-layers" not in k3
    # torchtitan's job config has no MTP key (its registry builds the layers): named as missing, unless none trains.
    tt_with = k3opt.to_launch(_mb22(mtp_layers=None), "torchtitan").missing
    assert any(m.decision.startswith("1 MTP layer") for m in tt_with)
    assert not any("MTP" in m.decision for m in k3opt.to_launch(_mb22(mtp_layers=0), "torchtitan").missing)


def test_a_job_without_mtp_plans_layouts_without_it():
    """A job's mtp_layers reaches the search's model and the layouts it returns: DeepSeek-V3 on 256 GB300 (PP1 EP32,
    a search of a second) plans the 671B main model, and evaluate() re-prices the returned layout the same way."""
    job = k3opt.Job(model="deepseek-v3", cluster="gb300-nvl72", gpus=256, context=4096, rows=1,
                    tokens_per_update=8388608, reserve_gib=2.0, domain_gpus_used=64, mtp_layers=0,
                    search={"pp": [1], "ep": [32]})
    plan = k3opt.plan(job, top=1, time_limit=20)
    best = plan.layouts[0]
    assert best.layout.mtp_layers == 0
    assert best.evaluation.params.total == pytest.approx(671e9, rel=1e-3)
    assert k3opt.evaluate(best.layout).params.total == best.evaluation.params.total


def test_a_job_asking_for_more_mtp_layers_than_the_model_has_is_one_line(tmp_path):
    """Kimi K3 has no MTP module: a job asking for one is refused with one line, exit 2 from the CLI."""
    from click.testing import CliRunner

    from k3opt.cli import main

    job = tmp_path / "job.toml"
    job.write_text('model = "kimi-k3"\ngpus = 512\ncontext = 4096\nrows = 1\ntokens_per_update = 16777216\n'
                   "mtp_layers = 1\n")
    with pytest.raises(k3opt.SpecError, match="mtp_layers \\(1\\) exceeds the 0 MTP layers of kimi-k3"):
        k3opt.plan(k3opt.load_job(job), top=1, time_limit=5)
    result = CliRunner().invoke(main, ["plan", str(job), "--time-limit", "5"])
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "leave mtp_layers out or set 0" in lines[0]


def test_explain_names_the_mtp_layers_a_layout_states():
    from click.testing import CliRunner

    from k3opt.cli import main

    out = CliRunner().invoke(main, ["explain", "mb-22-deepseek-v3-gb200"]).output
    assert " mtp_layers=0" in out.splitlines()[1]
    assert "mtp_layers" not in CliRunner().invoke(main, ["explain", "mb-13-deepseek-v3-gb200"]).output.splitlines()[1]
