"""k3opt sweep: a grid of jobs on the local pool and on Ray, resumable output, failing points recorded, bad sweep
files refused before any point runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from k3opt.cli import main
from k3opt.inputs.errors import PresetNotFoundError, SpecError
from k3opt.inputs.sweep import load_sweep
from k3opt.sweep import SweepSettings, point_key, run_sweep
from k3opt.sweep import rows as sweep_rows
from k3opt.sweep import run as sweep_run
from k3opt.sweep.store import read_rows

QWEN = """
name = "qwen-grid"
model = "qwen3-30b-a3b"
cluster = "b200"
tokens_per_update = 1048576
"""
NO_CLUSTER = QWEN.replace('cluster = "b200"\n', "")
GRID = QWEN + "[sweep]\ngpus = [8, 16]\ncontext = [4096, 8192]\n"
# gap 0: each point's best layout is the exact optimum, so two executors must agree row for row
EXACT = SweepSettings(top=1, time_limit=60.0, gap=0.0, threads=1)
DECISIONS = ["point", "sweep_gpus", "sweep_context", "status", "pp", "vp", "cp", "ep", "expert_fsdp", "dense_fsdp",
             "microbatches", "split_layers", "recompute", "fsdp_lifecycle", "precision", "ranked_step_time_s",
             "step_time_s", "peak_gib", "train_days"]


def _file(tmp_path: Path, text: str, name: str = "grid.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_the_grid_is_the_product_of_the_lists_in_file_order(tmp_path: Path) -> None:
    sw = load_sweep(_file(tmp_path, GRID))
    pts = sw.points()
    assert sw.size() == 4 == len(pts)
    assert [(p.values["gpus"], p.values["context"]) for p in pts] == [(8, 4096), (8, 8192), (16, 4096), (16, 8192)]
    assert all(p.job is not None and p.job.gpus == p.values["gpus"] and p.job.context == p.values["context"]
               for p in pts)
    assert pts[3].job.name == "qwen-grid gpus=16 context=8192"


def test_pool_and_local_ray_give_the_same_rows(tmp_path: Path) -> None:
    sw = load_sweep(_file(tmp_path, GRID))
    pool = run_sweep(sw, tmp_path / "pool.csv", EXACT, workers=2)
    assert pool.status.done == 4 and pool.status.failed == 0 and pool.status.skipped == 0
    run_sweep(sw, tmp_path / "ray.parquet", EXACT, ray="local")
    a, b = read_rows(tmp_path / "pool.csv"), read_rows(tmp_path / "ray.parquet")
    assert len(a) == len(b) == 4
    assert (a["status"] == "OPTIMAL").all()
    pd.testing.assert_frame_equal(a[DECISIONS], b[DECISIONS], check_dtype=False)
    # the same points, so the same keys
    assert list(a["point_key"]) == list(b["point_key"])


def test_each_row_prices_the_token_budget_from_its_own_step_time(tmp_path: Path) -> None:
    sw = load_sweep(_file(tmp_path, QWEN + "[sweep]\ngpus = [8]\n"))
    settings = SweepSettings(top=2, time_limit=30.0, threads=1, train_tokens=1e12, usd_per_gpu_hour=2.0)
    run_sweep(sw, tmp_path / "o.csv", settings, workers=1)
    df = read_rows(tmp_path / "o.csv")
    assert list(df["rank"]) == [1, 2]  # --top 2: the best and the next layout of the point
    assert df["ranked_step_time_s"].is_monotonic_increasing
    r = df.iloc[0]
    # one update of 1,048,576 tokens per ranked step: 1e12 tokens take 1e12 / 1,048,576 steps
    steps = 1e12 / 1048576
    assert r["train_days"] == pytest.approx(steps * r["ranked_step_time_s"] / 86400, rel=1e-9)
    # 8 B200 GPUs: one 8-GPU NVLink domain held, so GPU-hours = 8 x the hours
    assert r["gpus_held"] == 8
    assert r["gpu_hours_per_trillion_tokens"] == pytest.approx(8 * steps * r["ranked_step_time_s"] / 3600, rel=1e-9)
    assert r["train_usd"] == pytest.approx(2.0 * r["train_gpu_hours"], rel=1e-12)
    for col in ("optimizer_gib", "master_gib", "headroom_gib", "peak_device_gib", "gap", "bound_s"):
        assert col in df.columns


def test_a_failing_point_is_recorded_and_the_sweep_goes_on(tmp_path: Path) -> None:
    # 170 GiB kept back of a B200's HBM leaves less than the model state needs on 8 GPUs
    sw = load_sweep(_file(tmp_path, QWEN + "gpus = 8\n[sweep]\nreserve_gib = [170.0, 0.0]\n"))
    res = run_sweep(sw, tmp_path / "f.csv", SweepSettings(time_limit=30.0, threads=1), workers=1)
    df = read_rows(tmp_path / "f.csv")
    assert res.status.failed == 1 and res.status.done == 2
    bad, good = df.iloc[0], df.iloc[1]
    assert bad["status"] == "FAILED" and "no layout fits" in bad["reason"]
    assert good["status"] == "OPTIMAL"


def test_an_internal_error_in_one_point_is_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_a: object, **_k: object) -> None:
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(sweep_rows, "plan", broken)
    sw = load_sweep(_file(tmp_path, QWEN + "[sweep]\ngpus = [8]\n"))
    run_sweep(sw, tmp_path / "e.csv", SweepSettings(), workers=1)
    row = read_rows(tmp_path / "e.csv").iloc[0]
    assert row["status"] == "FAILED" and "ZeroDivisionError: boom" in row["reason"]


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_a_rerun_solves_only_the_points_not_in_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        suffix: str) -> None:
    grid = _file(tmp_path, QWEN + "gpus = 8\n[sweep]\ncontext = [4096, 8192]\n")
    settings = SweepSettings(time_limit=30.0, threads=1)
    out = tmp_path / f"r{suffix}"
    calls: list[int] = []
    real = sweep_run.point_rows

    def counting(p, k, s):  # noqa: ANN001, ANN202
        calls.append(p.index)
        return real(p, k, s)

    def stop_after_one(status) -> None:  # noqa: ANN001 - a sweep stopped after its first point, as if killed
        if status.done == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(sweep_run, "point_rows", counting)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(load_sweep(grid), out, settings, workers=1, progress=stop_after_one)
    first = read_rows(out)
    assert list(first["point"]) == [0] and calls == [0]
    res = run_sweep(load_sweep(grid), out, settings, workers=1)
    assert calls == [0, 1] and res.status.skipped == 1
    df = read_rows(out)
    assert list(df["point"]) == [0, 1]
    assert df.iloc[0]["wall_s"] == first.iloc[0]["wall_s"]  # the finished point was kept, not solved again
    # more threads or another price reuse the finished points, the price columns recomputed
    run_sweep(load_sweep(grid), out, SweepSettings(time_limit=30.0, threads=2, usd_per_gpu_hour=3.0), workers=1)
    assert calls == [0, 1]
    df = read_rows(out)
    assert df["train_usd"].tolist() == pytest.approx((3.0 * df["train_gpu_hours"]).tolist(), rel=1e-12)
    # another time limit can change the answer: a run with it solves both again
    run_sweep(load_sweep(grid), out, SweepSettings(time_limit=31.0, threads=1), workers=1)
    assert calls == [0, 1, 0, 1]


def test_a_killed_sweep_keeps_its_finished_points(tmp_path: Path) -> None:
    grid = _file(tmp_path, QWEN + "gpus = 8\n[sweep]\ncontext = [4096, 8192, 16384]\n")
    out = tmp_path / "k.csv"
    cmd = [sys.executable, "-c", "from k3opt.cli import main; main()", "sweep", str(grid), "--out", str(out),
           "--workers", "1", "--time-limit", "30"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert out.exists(), "no point finished"
        assert proc.poll() is None, "the sweep ended before it was killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kept = read_rows(out)
    assert 1 <= len(kept) < 3 and kept.iloc[0]["status"] == "OPTIMAL"
    res = run_sweep(load_sweep(grid), out, SweepSettings(time_limit=30.0, threads=1), workers=1)
    assert res.status.skipped == len(kept)
    assert list(read_rows(out)["point"]) == [0, 1, 2]


def test_the_key_follows_the_job_the_presets_and_the_settings(tmp_path: Path) -> None:
    pts = load_sweep(_file(tmp_path, GRID)).points()
    s = SweepSettings()
    assert point_key(pts[0].job, pts[0].values, s) == point_key(pts[0].job, pts[0].values, s)
    assert point_key(pts[0].job, pts[0].values, s) != point_key(pts[1].job, pts[1].values, s)
    assert point_key(pts[0].job, pts[0].values, s) != point_key(pts[0].job, pts[0].values,
                                                                SweepSettings(time_limit=61.0))
    assert point_key(pts[0].job, pts[0].values, s) == point_key(pts[0].job, pts[0].values,
                                                                SweepSettings(threads=4, usd_per_gpu_hour=1.0))
    # a model file whose content changes is another point, under the same path
    from k3opt.inputs.presets import preset_dir

    model = tmp_path / "m.toml"
    model.write_text((preset_dir("model") / "qwen3-30b-a3b.toml").read_text())
    job = pts[0].job.model_copy(update={"model": str(model)})
    before = point_key(job, pts[0].values, s)
    model.write_text(model.read_text().replace("num_layers = 48", "num_layers = 47"))
    assert "num_layers = 47" in model.read_text()
    assert point_key(job, pts[0].values, s) != before


@pytest.mark.parametrize("text, says", [
    (QWEN + "gpus = 8\n", "no [sweep] table"),
    (QWEN + "[sweep]\ngpux = [8]\n", "gpux: unknown key"),
    (QWEN + "[sweep]\ngpus = []\n", "gpus: the list is empty"),
    (QWEN + "[sweep]\ngpus = 8\n", "gpus: must be a list"),
    (QWEN + "[sweep]\ngpus = [8, \"many\"]\n", "gpus[1] = 'many'"),
    (QWEN + "[sweep]\ngpus = [8]\ncontext = [4096, -1]\n", "context[1] = -1"),
    (QWEN + "[sweep]\ngpus = [8]\ntarget = [\"deepspeed\"]\n", "target[0]"),
    (NO_CLUSTER + "[sweep]\ngpus = [8]\ncluster = [\"b200\", \"tpu-v9\"]\n", "cluster[1]"),
    (QWEN + "[sweep]\ngpus = [8]\nmodel = [\"qwen3-30b-a3b\"]\n", "both a job field and a [sweep] key"),
    (QWEN + "[sweep\ngpus = [8]\n", "not valid TOML"),
    (QWEN + "bogus = 1\n[sweep]\ngpus = [8]\n", "bogus"),
])
def test_a_bad_sweep_file_is_one_line_and_exit_2_before_any_point(tmp_path: Path, text: str, says: str) -> None:
    grid = _file(tmp_path, text)
    out = tmp_path / "never.csv"
    res = CliRunner().invoke(main, ["sweep", str(grid), "--out", str(out)])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("k3opt: error: ") and says in lines[0], res.output
    assert not out.exists()


def test_the_library_raises_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError):
        load_sweep(_file(tmp_path, QWEN + "[sweep]\ngpus = []\n"))
    with pytest.raises(PresetNotFoundError):
        load_sweep(_file(tmp_path, NO_CLUSTER + "[sweep]\ngpus = [8]\ncluster = [\"tpu-v9\"]\n"))
    with pytest.raises(PresetNotFoundError):
        load_sweep(tmp_path / "missing.toml")


def test_the_output_must_be_csv_or_parquet(tmp_path: Path) -> None:
    grid = _file(tmp_path, GRID)
    res = CliRunner().invoke(main, ["sweep", str(grid), "--out", str(tmp_path / "o.xlsx")])
    assert res.exit_code == 2 and ".csv or .parquet" in res.output


def test_the_cli_sweep_prints_each_point_and_draws_the_picture(tmp_path: Path) -> None:
    grid = _file(tmp_path, QWEN + "[sweep]\ngpus = [8, 16]\nreserve_gib = [0.0, 170.0]\n")
    out, png = tmp_path / "o.csv", tmp_path / "o.png"
    res = CliRunner().invoke(main, ["sweep", str(grid), "--out", str(out), "--workers", "1", "--time-limit", "30",
                                    "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "gpus=8 reserve_gib=0.0: OPTIMAL" in res.output
    assert "gpus=16 reserve_gib=170.0: FAILED: no layout fits" in res.output
    assert "wrote 4 rows" in res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png2 = tmp_path / "again.png"
    res = CliRunner().invoke(main, ["sweep-plot", str(out), str(png2)])
    assert res.exit_code == 0 and png2.read_bytes()[:4] == b"\x89PNG"


def test_a_targeted_point_carries_its_limit_prices(tmp_path: Path) -> None:
    data = Path(__file__).parents[1] / "data"
    grid = _file(tmp_path, f'model = "{data / "tiny-moe.toml"}"\ncluster = "{data / "slow-cluster.toml"}"\n'
                           'gpus = 8\ncontext = 2048\ntokens_per_update = 32768\nreserve_gib = 1.5\n[search]\n'
                           'pp = [2]\nep = [2, 4]\nvp = [1, 2]\nrecompute = ["full"]\n'
                           '[sweep]\ntarget = ["megatron-bridge"]\n')
    run_sweep(load_sweep(grid), tmp_path / "t.csv", SweepSettings(time_limit=30.0, threads=1), workers=1)
    row = read_rows(tmp_path / "t.csv").iloc[0]
    assert row["target"] == "megatron-bridge" and row["vp"] == 1
    assert row["limits_cost_s"] == pytest.approx(row["ranked_step_time_s"] - row["best_without_target_s"])
    saves = [c for c in row.index if c.startswith("limit_") and c.endswith("_saves_s")]
    # within the 1% gap each plan is proven to, lifting one limit saves at most what lifting all of them does
    slack = 0.011 * row["ranked_step_time_s"]
    assert saves and all(-slack <= row[c] <= row["limits_cost_s"] + slack for c in saves)


def test_the_price_is_paid_on_the_gpus_held() -> None:
    # 64 GPUs used of one 72-GPU rack: the idle 8 are paid for too
    row = {"status": "OPTIMAL", "ranked_tokens_per_s": 2.0e6, "gpus": 64, "gpus_held": 72}
    out = sweep_rows.price(row, SweepSettings(train_tokens=1.8e12, usd_per_gpu_hour=3.0))
    # 1.8e12 tokens at 2e6 tokens/s: 9e5 s = 250 h = 10.4167 days; 72 GPUs x 250 h = 18,000 GPU-hours
    assert out["train_days"] == pytest.approx(9e5 / 86400, rel=1e-12)
    assert out["train_gpu_hours"] == pytest.approx(18_000.0, rel=1e-12)
    assert out["train_usd"] == pytest.approx(54_000.0, rel=1e-12)
    assert out["gpu_hours_per_trillion_tokens"] == pytest.approx(10_000.0, rel=1e-12)  # 72 x 5e5 s / 3600
    failed = sweep_rows.price({"status": "FAILED", "reason": "x"}, SweepSettings())
    assert failed["train_days"] is None and failed["train_usd"] is None
