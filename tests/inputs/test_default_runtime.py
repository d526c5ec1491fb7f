"""A job that names no runtime plans with its cluster's `default_runtime` (the memory outside live tensors), so a
plain job's plan fits on the device line; `runtime = "none"` plans on live tensors as before, explicitly; an
unknown runtime name is one clear line. Expected figures come from the runtime preset file's items (read here
with tomllib), never from k3opt's own budget formula."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

import k3opt
from k3opt.cli import main
from k3opt.inputs.runtime import planning_runtime, resolve_job_runtime
from k3opt.search import enumerate_frames
from k3opt.search.frames import allocated_capacity_bytes

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parents[1] / "data"
GIB, MIB = 2**30, 2**20
GB200_RUNTIME = "megatron-te-hybridep-gb200"
PLAIN = {"gpus": 512, "context": 4096, "rows": 1, "tokens_per_update": 16_777_216, "reserve_gib": 5}
"""The plain job: model and cluster by default (kimi-k3 on gb200-nvl72), nothing about the runtime."""


def _preset() -> dict:
    return tomllib.loads((ROOT / "constraints/runtimes" / f"{GB200_RUNTIME}.toml").read_text())


def live_bound_bytes(hbm_mib: int, reserve_gib: float) -> int:
    """The largest live-tensor peak a rank of a multi-GPU job can have with the GB200 runtime and still keep its
    device peak under HBM - reserve, from the preset's items (a bound: it counts only what every rank holds):
      device >= (live + cuBLAS and TE workspaces) x (1 + allocator slack) + CUDA context + one NCCL collective
      communicator (every data-parallel job has one: channels x one connection's Simple + LL + LL128 buffers,
      rounded up to the allocation granularity).
    On gb200-nvl72 with a 5 GiB reserve: 189,471 - 5,120 = 184,351 MiB; - 973 MiB context - 16 x 10 MiB
    (4,194,304 + 524,288 + 4,915,200 = 9,633,792 B -> 5 x 2 MiB) = 183,218 MiB; / 1.1333 = 161,667.7 MiB;
    - (8,519,680 + 5 x 33,555,456) B = 168.1 MiB -> 161,499.6 MiB = 157.7 GiB, 22.3 GiB under HBM - reserve."""
    rt = _preset()
    conn_raw = rt["nccl_buffsize_bytes"] + rt["nccl_ll_buffer_bytes"] + rt["nccl_ll128_buffer_bytes"]
    gran = rt["nccl_alloc_granularity_bytes"]
    one_communicator = rt["nccl_coll_channels"] * (-(-conn_raw // gran) * gran)
    outside = rt["cuda_context_mib"] * MIB + one_communicator
    workspaces = rt["cublas_handles"] * rt["cublas_workspace_bytes"] + rt["te_workspaces"] * rt["te_workspace_bytes"]
    line = hbm_mib * MIB - reserve_gib * GIB
    return int((line - outside) / (1 + rt["allocator_slack"]) - workspaces)


def test_the_bound_is_the_figure_worked_in_its_docstring():
    assert live_bound_bytes(189_471, 5) / MIB == pytest.approx(161_499.6, abs=0.1)


def test_gb200_names_its_runtime_and_clusters_without_a_preset_name_none():
    assert k3opt.load_cluster("gb200-nvl72").default_runtime == GB200_RUNTIME
    assert (ROOT / "constraints/runtimes" / f"{GB200_RUNTIME}.toml").is_file()
    for name in ("gb300-nvl72", "b200", "h100-sxm", "h200-sxm"):
        assert k3opt.load_cluster(name).default_runtime is None


def test_plain_job_resolves_to_the_cluster_default_and_none_to_live_tensors():
    plain = k3opt.Job(**PLAIN)
    assert plain.runtime is None  # the job as written
    choice = planning_runtime(plain)
    assert (choice.name, choice.origin) == (GB200_RUNTIME, "cluster default")
    assert "gb200-nvl72's default_runtime" in choice.line()
    resolved = resolve_job_runtime(plain)
    assert resolved.runtime == GB200_RUNTIME
    assert resolve_job_runtime(resolved) is resolved  # applied once: a resolved job passes unchanged

    none = resolve_job_runtime(k3opt.Job(**PLAIN, runtime="none"))
    assert none.runtime is None and planning_runtime(none).origin == "none"
    assert resolve_job_runtime(none).runtime is None  # not re-resolved to the default
    named = planning_runtime(k3opt.Job(**PLAIN, runtime=GB200_RUNTIME))
    assert (named.name, named.origin) == (GB200_RUNTIME, "job")
    h100 = planning_runtime(k3opt.Job(**PLAIN, cluster="h100-sxm"))
    assert (h100.name, h100.origin) == (None, "no cluster default")


def test_search_line_is_the_runtime_budget_for_a_plain_job_and_hbm_minus_reserve_with_none():
    model, cluster = k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72")
    plain = resolve_job_runtime(k3opt.Job(**PLAIN))
    none = resolve_job_runtime(k3opt.Job(**PLAIN, runtime="none"))
    frames = enumerate_frames(plain, model, 512, cluster)[::500]
    assert frames
    bound = live_bound_bytes(cluster.hbm_mib, 5)
    for f in frames:
        assert allocated_capacity_bytes(plain, f, model, cluster) <= bound
        # Live tensors only: HBM - reserve = 189,471 MiB - 5,120 MiB.
        assert allocated_capacity_bytes(none, f, model, cluster) == 184_351 * MIB


def test_plain_job_plans_on_the_device_line_under_a_short_limit():
    """K3 on 512 GB200 GPUs with nothing but the job's sizes (VP searched, no [search] table, no runtime): a
    fitting layout with its proven gap under a time limit far below a proof, planned with gb200-nvl72's runtime,
    so its device peak (not only its live tensors) is under HBM - reserve."""
    plan = k3opt.plan(k3opt.Job(**PLAIN), top=1, time_limit=30)
    assert plan.layouts and plan.status in ("OPTIMAL", "FEASIBLE")
    assert 0 <= plan.gap < 1 and plan.bound <= plan.layouts[0].rank_time_s
    best = plan.layouts[0]
    ev = best.evaluation
    assert best.layout.runtime == GB200_RUNTIME and ev.runtime is not None and ev.runtime.name == GB200_RUNTIME
    assert ev.fits and all(r.device_bytes <= 184_351 * MIB for r in ev.ranks)
    assert ev.peak_bytes <= live_bound_bytes(189_471, 5)
    # The device peak holds the runtime's items: at least the CUDA context and the allocator slack on top.
    assert ev.peak_device_bytes >= ev.peak_bytes * (1 + _preset()["allocator_slack"]) + 973 * MIB
    assert planning_runtime(plan.job).origin == "cluster default"


# --------------------------------------------------------------- small model: default vs "none", end to end


@pytest.fixture(scope="module")
def cluster_with_default(tmp_path_factory) -> Path:
    """The slow test cluster (tiny model, GiB-scale memory) naming the GB200 runtime as its default."""
    path = tmp_path_factory.mktemp("clusters") / "slow-default.toml"
    text = (DATA / "slow-cluster.toml").read_text().replace('name = "slow-test"', 'name = "slow-default"')
    path.write_text(text + f'default_runtime = "{GB200_RUNTIME}"\n')
    return path


def _tiny_job(cluster: Path | str, **extra) -> dict:
    return {"model": str(DATA / "tiny-moe.toml"), "cluster": str(cluster), "gpus": 8, "context": 2048, "rows": 1,
            "tokens_per_update": 32768, "reserve_gib": 0.5,
            "search": {"pp": [1, 2], "vp": [1], "cp": [1], "ep": [2, 4], "expert_fsdp": [1], "dense_fsdp": [1, 2]},
            **extra}


def test_runtime_none_plans_exactly_as_a_cluster_without_a_default(cluster_with_default):
    """On a cluster naming a default runtime: without `runtime` the plan's device peaks fit under HBM - reserve
    with the runtime's items; `runtime = "none"` gives the very plan of the same cluster without a default
    (live tensors against HBM - reserve)."""
    plan = k3opt.plan(k3opt.Job.model_validate(_tiny_job(cluster_with_default)), top=2, gap=0)
    line = 4096 * MIB - GIB // 2
    for it in plan.layouts:
        assert it.layout.runtime == GB200_RUNTIME and it.evaluation.fits
        assert it.evaluation.peak_device_bytes <= line
        assert it.evaluation.peak_bytes <= live_bound_bytes(4096, 0.5)
    none = k3opt.plan(k3opt.Job.model_validate(_tiny_job(cluster_with_default, runtime="none")), top=2,
                      gap=0)
    bare = k3opt.plan(k3opt.Job.model_validate(_tiny_job(DATA / "slow-cluster.toml")), top=2, gap=0)
    assert [it.layout.runtime for it in none.layouts] == [None, None]
    assert [it.layout.model_dump(exclude={"cluster"}) for it in none.layouts] == \
        [it.layout.model_dump(exclude={"cluster"}) for it in bare.layouts]
    assert [it.rank_time_s for it in none.layouts] == [it.rank_time_s for it in bare.layouts]
    for it in none.layouts:
        assert it.evaluation.peak_device_bytes == it.evaluation.peak_bytes  # live tensors only
    # The runtime's memory binds here: the best layout on live tensors does not fit once the runtime counts.
    assert plan.layouts[0].rank_time_s > none.layouts[0].rank_time_s
    assert not k3opt.evaluate(none.layouts[0].layout, cluster=str(cluster_with_default),
                              model=str(DATA / "tiny-moe.toml"), runtime=GB200_RUNTIME).fits


def _write(path: Path, data: dict) -> Path:
    search = data.pop("search", {})
    lines = [f"{k} = {json.dumps(v)}" for k, v in data.items()] + ["[search]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in search.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_cli_plan_says_which_runtime_and_where_it_came_from(cluster_with_default, tmp_path):
    job = _write(tmp_path / "job.toml", _tiny_job(cluster_with_default))
    out = CliRunner().invoke(main, ["plan", str(job), "--top", "1"])
    assert out.exit_code == 0, out.output
    lines = [ln for ln in out.output.splitlines() if ln.startswith("runtime ")]
    assert lines == [f"runtime {GB200_RUNTIME} (slow-default's default_runtime; the job names none, runtime = "
                     "\"none\" plans on live tensors only): every rank's device peak <= HBM - reserve"]
    out = CliRunner().invoke(main, ["plan", str(job), "--top", "1", "--json"])
    data = json.loads(out.output)
    assert (data["runtime"], data["runtime_from"]) == (GB200_RUNTIME, "cluster default")
    assert data["layouts"][0]["layout"]["runtime"] == GB200_RUNTIME
    # Where the proof stopped: nothing left open when it ran to its gap (a FEASIBLE plan:
    # tests/search/test_seed_proof.py).
    if data["status"] == "OPTIMAL":
        assert (data["open_shapes"], data["holding"]) == (0, None)
    else:
        assert data["open_shapes"] >= 1 and set(data["holding"]) == {"shape", "bound_s", "kind", "line_s"}
    out = CliRunner().invoke(main, ["pareto", str(job), "--top", "1"])
    assert out.exit_code == 0, out.output
    assert f"runtime {GB200_RUNTIME} (slow-default's default_runtime;" in out.output

    none = _write(tmp_path / "none.toml", _tiny_job(cluster_with_default, runtime="none"))
    out = CliRunner().invoke(main, ["plan", str(none), "--top", "1"])
    assert out.exit_code == 0, out.output
    assert "runtime none (the job's runtime = \"none\"): live tensors only" in out.output


def test_unknown_runtime_in_a_job_is_one_line(tmp_path):
    job = _write(tmp_path / "job.toml", {**PLAIN, "runtime": "megatron-h100"})
    with pytest.raises(k3opt.PresetNotFoundError, match="unknown runtime preset 'megatron-h100'; known presets: "
                                                        f"{GB200_RUNTIME}"):
        k3opt.load_job(job)
    with pytest.raises(k3opt.PresetNotFoundError, match="unknown runtime preset 'megatron-h100'"):
        k3opt.plan(k3opt.Job(**PLAIN, runtime="megatron-h100"), top=1)  # not loaded from a file
    out = CliRunner().invoke(main, ["plan", str(job), "--top", "1", "--time-limit", "5"])
    assert out.exit_code == 2
    assert out.output.count("\n") == 1 and out.output.startswith("k3opt: error: unknown runtime preset")


def test_unknown_default_runtime_in_a_cluster_is_one_line(tmp_path):
    cluster = tmp_path / "c.toml"
    cluster.write_text((DATA / "slow-cluster.toml").read_text() + 'default_runtime = "no-such-stack"\n')
    with pytest.raises(k3opt.PresetNotFoundError, match="cluster slow-test: default_runtime: unknown runtime"):
        k3opt.load_cluster(cluster)
    job = _write(tmp_path / "job.toml", _tiny_job(cluster))
    out = CliRunner().invoke(main, ["plan", str(job), "--top", "1"])
    assert out.exit_code == 2 and out.output.count("\n") == 1
    assert "default_runtime: unknown runtime preset 'no-such-stack'" in out.output


def test_evaluate_and_explain_take_none_as_no_runtime():
    """evaluate() keeps its meaning: the layout's runtime, absent = live tensors; "none" says so explicitly and
    overrides a layout that names one."""
    ref = k3opt.load_layout("k3-gb200-512-reference")
    assert ref.runtime == GB200_RUNTIME
    ev = k3opt.evaluate(ref, runtime="none")
    assert ev.runtime is None and ev.peak_device_bytes == ev.peak_bytes
    assert k3opt.make_layout(**{**ref.model_dump(), "runtime": "none"}).runtime is None
    out = CliRunner().invoke(main, ["explain", "k3-gb200-512-reference", "--runtime", "none"])
    assert out.exit_code == 0, out.output
    assert (f"runtime none (live tensors only); a plan on gb200-nvl72 uses {GB200_RUNTIME} "
            f"(--runtime {GB200_RUNTIME})") in out.output
