"""The lab's API: the numbers evaluate(), plan() and pareto() give, `k3opt explain`'s ledger for the reference run,
downloads that load back, one plan per client, and one line beside its control for every bad input."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from click.testing import CliRunner  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

import k3opt  # noqa: E402
from k3opt.cli import main  # noqa: E402
from k3opt.inputs.presets import load_layout  # noqa: E402
from k3opt.launch import to_launch  # noqa: E402
from k3opt.serve import create_app  # noqa: E402

REF = "k3-gb200-512-reference"
SMALL_JOB = {"model": "qwen3-30b-a3b", "cluster": "b200", "runtime": "cluster-default", "gpus": "8",
             "domain_gpus_used": "", "context": "4096", "rows": "1", "reserve_gib": "0", "precision": "bf16",
             "tokens_per_update": "1048576", "target": "none", "time_limit": "30", "top": "3"}


@pytest.fixture(scope="module")
def client() -> TestClient:
    with TestClient(create_app()) as c:
        yield c


@pytest.fixture(scope="module")
def default(client: TestClient) -> dict:
    return client.get("/api/options").json()["default"]


def _wait(client: TestClient, run_id: str, limit_s: float = 90.0) -> dict:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        st = client.get(f"/api/plans/{run_id}").json()
        if st["state"] != "running":
            return st
        time.sleep(0.2)
    raise AssertionError(f"plan {run_id} still running after {limit_s} s")


def test_the_explorer_opens_on_the_reference_run(default: dict) -> None:
    ref = load_layout(REF)
    assert (default["pp"], default["ep"], default["dense_fsdp"], default["microbatches"]) == (8, 64, 64, 64)
    assert default["split"] == "12x7+9" and sum(ref.split) == 93  # 7 chunks of 12 layers and 9: K3's 93 layers
    assert default["model"] == "kimi-k3" and default["cluster"] == "gb200-nvl72"


def test_the_reference_ledger_is_the_one_explain_prints(client: TestClient, default: dict) -> None:
    view = client.post("/api/evaluate", json=default).json()["view"]
    text = CliRunner().invoke(main, ["explain", REF]).output
    printed = {}
    for line in text.splitlines():
        m = re.match(r"^(\S.*?)\s{2,}((?:-?[\d,]+\.\d\d\s*){8})$", line)
        if m:
            printed[m.group(1).strip()] = m.group(2).split()
    rows = {r[0]: r[1:] for r in view["table"]["rows"]}
    assert view["table"]["columns"] == [f"rank{i}" for i in range(8)]
    assert len(printed) >= 30 and set(printed) <= set(rows)
    for term, cells in printed.items():
        assert rows[term] == cells, term
    # The worst rank's device peak, as explain's summary line gives it.
    assert f"device {view['summary']['peak_device_gib']:.2f} GiB" in text


def test_evaluate_returns_what_evaluate_gives(client: TestClient, default: dict) -> None:
    form = {**default, "pp": "4", "split": "", "toggles": {**default["toggles"], "fp8_activations": True}}
    data = client.post("/api/evaluate?full=1", json=form).json()
    lay = load_layout(REF).model_copy(update={"pp": 4, "split": [24, 23, 23, 23],
                                              "toggles": k3opt.Toggles(fp8_activations=True)})
    ev = k3opt.evaluate(lay)
    assert data["form"]["split"] == "24+23x3"  # 93 = 24 + 3 x 23: the even split, the larger chunk first
    s = data["view"]["summary"]
    assert s["rank_time_s"] == pytest.approx(ev.step.rank_time_s, rel=1e-12)
    assert s["peak_device_gib"] * 2**30 == pytest.approx(ev.peak_device_bytes, rel=1e-12)
    assert data["evaluation"]["ranks"][0]["ledger_bytes"] == ev.ranks[0].ledger
    segs = {sg["key"]: sg["gib"] for sg in data["view"]["ledger"]["segments"]}
    assert segs["master"] == pytest.approx([r.ledger["master"] / 2**30 for r in ev.ranks])
    # The stacked segments reach each rank's device line: ledger peak + allocated, reserved, device increments.
    tops = [sum(v[i] for v in segs.values()) for i in range(4)]
    assert tops == pytest.approx([r.device_bytes / 2**30 for r in ev.ranks])
    # The timeline holds every forward and backward: 2 x PP x VP x M operations.
    assert len(data["view"]["timeline"]["ops"]) == 2 * 4 * 1 * 64


def test_the_mtp_control_trains_the_run_without_its_mtp_module(client: TestClient) -> None:
    """MB-22 ran DeepSeek-V3 "w/o MTP" (mtp_layers = 0 in its file): the explorer loads it with the control at 0 and
    prices it as evaluate() does; emptied, the control trains the preset's one MTP layer, as the layout without
    the field does (more parameters: the MTP layer's)."""
    from k3opt.serve.views import form_of

    lay = load_layout("mb-22-deepseek-v3-gb200")
    form = form_of(lay, lay.runtime)
    assert form["mtp_layers"] == 0
    without = client.post("/api/evaluate", json=form).json()
    assert without["form"]["mtp_layers"] == 0
    assert without["view"]["summary"]["rank_time_s"] == pytest.approx(k3opt.evaluate(lay).step.rank_time_s, rel=1e-12)
    with_mtp = client.post("/api/evaluate", json={**form, "mtp_layers": ""}).json()
    ev = k3opt.evaluate(lay.model_copy(update={"mtp_layers": None}))
    assert with_mtp["form"]["mtp_layers"] == ""
    assert with_mtp["view"]["summary"]["rank_time_s"] == pytest.approx(ev.step.rank_time_s, rel=1e-12)
    assert ev.params.total > k3opt.evaluate(lay).params.total


def test_offload_and_graph_controls_round_trip_and_price_as_evaluate(client: TestClient, default: dict) -> None:
    """MB-13's recipe graphs attention, the router and the preprocessing with TransformerEngine: the explorer loads
    them and prices the layout as evaluate() does. Offloading moe_act from the explorer (the reference under selective
    recompute) moves the routed experts' fc1 output to host memory, as the layout field does: the worst rank holds
    less and the host holds it."""
    from k3opt.serve.views import form_of

    lay = load_layout("mb-13-deepseek-v3-gb200")
    form = form_of(lay, lay.runtime)
    assert form["cuda_graph_impl"] == "transformer_engine"
    assert form["cuda_graph_modules"] == "attn, moe_router, moe_preprocess"
    assert form["offload_modules"] == ""
    data = client.post("/api/evaluate", json=form).json()
    assert data["form"]["cuda_graph_modules"] == form["cuda_graph_modules"]
    assert data["view"]["summary"]["rank_time_s"] == pytest.approx(k3opt.evaluate(lay).step.rank_time_s, rel=1e-12)

    selective = {**default, "recompute": "selective"}  # the reference recomputes whole layers: nothing to offload
    plain = client.post("/api/evaluate", json=selective).json()
    off = client.post("/api/evaluate", json={**selective, "offload_modules": "moe_act"}).json()
    assert off["form"]["offload_modules"] == "moe_act"
    ref = load_layout("k3-gb200-512-reference")  # the explorer's default form
    ev = k3opt.evaluate(type(ref).model_validate({**ref.model_dump(), "recompute": "selective",
                                                  "offload_modules": ["moe_act"]}))
    assert off["view"]["summary"]["rank_time_s"] == pytest.approx(ev.step.rank_time_s, rel=1e-12)
    assert max(r.host_bytes for r in ev.ranks) > 0
    assert off["view"]["summary"]["peak_gib"] < plain["view"]["summary"]["peak_gib"]


def test_a_megatron_layout_string_sets_the_split(client: TestClient) -> None:
    """MB-12's release layout string (the embedding and four layers, 14 stages of four, then one layer, the MTP
    layer and the loss) round-trips through the explorer: the form shows it and its split, and the evaluation is
    evaluate()'s."""
    from k3opt.serve.views import form_of

    lay = load_layout("mb-12-deepseek-v3-gb300")
    form = form_of(lay, lay.runtime)
    assert form["pipeline_layout"] == "Et*4|(t*4|)*14tmL" and form["split"] == "4x15+1"
    data = client.post("/api/evaluate", json={**form, "split": "whatever the string says"}).json()
    assert data["form"]["pipeline_layout"] == "Et*4|(t*4|)*14tmL"
    ev = k3opt.evaluate(lay)
    assert data["view"]["summary"]["rank_time_s"] == pytest.approx(ev.step.rank_time_s, rel=1e-12)


def test_a_plan_returns_what_k3opt_plan_gives_and_loads_into_the_explorer(client: TestClient) -> None:
    run = client.post("/api/plans", json={**SMALL_JOB, "toggles": {}}, headers={"X-K3opt-Client": "a"}).json()
    st = _wait(client, run["id"])
    assert st["state"] == "done" and st["progress"]["phase"] == "done"
    res = st["result"]
    job = k3opt.Job(model="qwen3-30b-a3b", cluster="b200", gpus=8, tokens_per_update=1048576)
    lib = k3opt.plan(job, top=3, time_limit=30)
    assert res["status"] == lib.status == "OPTIMAL"
    best, lib_best = res["layouts"][0]["rank_time_s"], lib.layouts[0].rank_time_s
    assert abs(best - lib_best) <= 0.01 * max(best, lib_best)  # both proven to the 1% gap
    form = res["layouts"][0]["form"]
    view = client.post("/api/evaluate", json=form).json()["view"]
    assert view["summary"]["rank_time_s"] == pytest.approx(best, rel=1e-12)
    csv = client.get(f"/api/plans/{run['id']}/csv")
    assert csv.status_code == 200 and csv.text.splitlines()[0].startswith("rank,gpus,pp,")
    assert len(csv.text.splitlines()) == 1 + len(res["layouts"])


def test_a_pareto_run_gives_front_points_with_their_proof(client: TestClient) -> None:
    run = client.post("/api/plans", json={**SMALL_JOB, "time_limit": "6", "pareto": True},
                      headers={"X-K3opt-Client": "front"}).json()
    st = _wait(client, run["id"])
    pts = st["result"]["pareto"]
    assert st["state"] == "done" and pts
    peaks = [p["peak_gib"] for p in pts]
    times = [p["rank_time_s"] for p in pts]
    # A front: along rising peak the step time falls, and each point's bound is below its step time.
    order = sorted(range(len(pts)), key=lambda i: peaks[i])
    assert all(times[a] >= times[b] for a, b in zip(order, order[1:], strict=False))
    assert all(p["front_bound_s"] <= p["rank_time_s"] * (1 + 1e-9) for p in pts)
    csv = client.get(f"/api/plans/{run['id']}/csv").text
    assert "proven" in csv.splitlines()[0].split(",")


def test_a_new_plan_cancels_the_clients_running_one(client: TestClient, default: dict) -> None:
    long = {**default, "tokens_per_update": "16777216", "target": "none", "time_limit": "120", "top": "1"}
    first = client.post("/api/plans", json=long, headers={"X-K3opt-Client": "c"}).json()
    time.sleep(1.0)
    second = client.post("/api/plans", json={**SMALL_JOB, "toggles": {}}, headers={"X-K3opt-Client": "c"}).json()
    st = _wait(client, first["id"], 60)
    assert st["state"] == "cancelled" and st["elapsed_s"] < 60
    assert _wait(client, second["id"])["state"] == "done"
    again = client.post("/api/plans", json=long, headers={"X-K3opt-Client": "c"}).json()
    client.post(f"/api/plans/{again['id']}/cancel")
    assert _wait(client, again["id"], 60)["state"] == "cancelled"


def test_the_server_runs_a_bounded_number_of_plans() -> None:
    with TestClient(create_app(max_running=1)) as c:
        form = {**SMALL_JOB, "model": "kimi-k3", "cluster": "gb200-nvl72", "gpus": "512",
                "tokens_per_update": "16777216", "time_limit": "60"}
        first = c.post("/api/plans", json=form, headers={"X-K3opt-Client": "x"}).json()
        r = c.post("/api/plans", json=form, headers={"X-K3opt-Client": "y"})
        assert r.status_code == 429 and "\n" not in r.json()["error"] and "try again" in r.json()["error"]
        c.post(f"/api/plans/{first['id']}/cancel")
        assert _wait(c, first["id"], 60)["state"] == "cancelled"


def test_downloads_load_back(client: TestClient, default: dict, tmp_path: Path) -> None:
    toml = client.post("/api/download/toml", json=default)
    assert toml.status_code == 200 and "attachment" in toml.headers["content-disposition"]
    (tmp_path / "lab.toml").write_text(toml.text)
    back, ref = load_layout(tmp_path / "lab.toml"), load_layout(REF)
    assert back.model_dump(exclude={"name", "measured", "source"}) == \
        ref.model_dump(exclude={"name", "measured", "source"})
    for fmt in ("megatron-bridge", "megatron-lm", "torchtitan"):
        r = client.post(f"/api/download/{fmt}", json=default)
        assert r.status_code == 200 and r.text == to_launch(back, fmt).text


def test_validation_lists_every_measured_run_with_its_fit(client: TestClient) -> None:
    v = client.get("/api/validation").json()
    fit = {r["layout"]: r for r in v["fit"]}
    assert fit[REF]["fits"] and fit[REF]["hbm_gib"] == pytest.approx(189_471 / 1024, abs=0.01)  # nvidia-smi MiB
    # the verdict the lab prints is the report's own: MB-2 runs on allocator retries, the proxy claims no fit
    assert fit[REF]["verdict"] == "yes" and fit["MB-2"]["verdict"].startswith("with allocator retries")
    assert fit["k3-4layer-dist-muon-8gpu"]["verdict"] == "n/a (ran on MI355X)"
    assert fit["MB-2"]["floor_gib"] < fit["MB-2"]["hbm_gib"] < fit["MB-2"]["device_gib"]
    assert {r["layout"] for r in v["memory"]} <= set(fit)
    assert v["throughput"]["rows"] and all("error_pct" in r for r in v["throughput"]["rows"])


def test_a_sweep_given_at_start_is_listed_with_its_picture(tmp_path: Path) -> None:
    csv = tmp_path / "sweep.csv"
    csv.write_text(
        "point,key,sweep_gpus,status,gap,rank,pp,vp,cp,ep,expert_fsdp,dense_fsdp,microbatches,recompute,"
        "ranked_step_time_s,ranked_tokens_per_s_per_gpu_held,train_days,train_tokens,gpus,reason\n"
        "0,k0,8,OPTIMAL,0.0,1,1,1,1,8,1,8,16,selective,5.13,25000,80.0,1.5e13,8,\n"
        "1,k1,16,OPTIMAL,0.0,1,1,1,1,16,1,16,8,selective,2.59,24900,40.0,1.5e13,16,\n")
    with TestClient(create_app([csv])) as c:
        sweeps = c.get("/api/sweeps").json()
        assert [s["file"] for s in sweeps] == ["sweep.csv"]
        assert [r["sweep_gpus"] for r in sweeps[0]["rows"]] == [8, 16]
        png = c.get(sweeps[0]["png"])
        assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"
        assert c.get("/api/sweeps/5.png").status_code == 400


# ----------------------------------------------------------------------------------------------- bad input

BAD_LAYOUT = [
    # (control, bad value, words the one line must hold)
    ("model", "nope", "unknown value 'nope'"),
    ("model", "/etc/passwd", "unknown value"),
    ("cluster", "nope", "unknown value 'nope'"),
    ("runtime", "../secret", "unknown value"),
    ("gpus", "abc", "not a number"),
    ("gpus", "0", "not a positive whole number"),
    ("gpus", "2000000", "less than or equal to 1048576"),
    ("domain_gpus_used", "-3", "not a positive whole number"),
    ("domain_gpus_used", "100", "domain_gpus_used"),
    ("context", "4096.5", "not a positive whole number"),
    ("rows", "", "required"),
    ("reserve_gib", "-1", ">= 0"),
    ("reserve_gib", "lots", "not a number"),
    ("pp", "0", "not a positive whole number"),
    ("pp", "7", "divisible by pp"),
    ("vp", "x", "not a number"),
    ("vp", "50", "cannot fill pp x vp = 400 chunks"),
    ("cp", "3", "divisible by pp * cp"),
    ("ep", "7", "ep (7) must divide"),
    ("expert_fsdp", "3", "expert_fsdp (3) must divide"),
    ("dense_fsdp", "5", "dense_fsdp (5) must divide"),
    ("microbatches", "-1", "not a positive whole number"),
    ("split", "12x7+8", "covers 92 layers"),
    ("split", "twelve", "is not LAYERS or LAYERSxCHUNKS"),
    ("recompute", "sometimes", "unknown value 'sometimes'"),
    ("recompute_modules", "core_attention", "unknown module 'core_attention'"),
    ("offload_modules", "fc2", "unknown module 'fc2'"),
    ("offload_modules", "attn_proj", "needs 'core_attn' beside it"),
    ("offload_modules", "moe_act moe_act", "lists a module twice"),
    ("cuda_graph_impl", "sometimes", "unknown value 'sometimes'"),
    ("cuda_graph_modules", "everything", "unknown module 'everything'"),
    ("cuda_graph_modules", "attn", "need cuda_graph_impl"),
    ("pipeline_layout", "Et*4|(t*4|)*14tmX", "pipeline_layout"),
    ("pipeline_layout", "Et*20|t*20|t*20|t*32L", "pipeline_layout"),
    ("param_gather", "sometimes", "unknown value 'sometimes'"),
    ("activation_offload_layers", "-2", "not a positive whole number"),
    ("activation_offload_layers", "12", "priced for one chunk"),
    ("mtp_layers", "1", "exceeds the 0 MTP layers of kimi-k3"),
    ("mtp_layers", "-1", "not a whole number >= 0"),
    ("mtp_layers", "two", "not a whole number >= 0"),
    ("recompute_modules", "mla_up_proj", 'need recompute = "selective"'),
    ("fsdp_lifecycle", "never", "unknown value"),
    ("dense_sharding", "zero9", "unknown value"),
    ("expert_sharding", "zero9", "unknown value"),
    ("grad_dtype", "fp4", "unknown value"),
    ("optimizer_state_dtype", "fp4", "unknown value"),
    ("precision", "int2", "unknown value"),
    ("toggles", {"warp_drive": True}, "unknown toggle 'warp_drive'"),
    ("toggles", {"fp8_activations": "yes"}, "true or false"),
]
@pytest.mark.parametrize(("control", "value", "words"), BAD_LAYOUT, ids=[f"{c}={v}" for c, v, _ in BAD_LAYOUT])
def test_every_explorer_control_has_one_line_beside_it(client: TestClient, default: dict, control: str, value,
                                                       words: str) -> None:
    # `changed`: the page names the control just edited, and a rule over several controls (PP 7 breaks `gpus (512)
    # must be divisible by pp * cp`) is reported beside it.
    form = {**default, control: value, "changed": control}
    if control in ("vp", "pp", "cp"):
        form["split"] = ""
    for path in ("/api/evaluate", "/api/download/toml"):
        r = client.post(path, json=form)
        assert r.status_code == 400, r.text
        err = r.json()
        assert words in err["error"] and "\n" not in err["error"]
        assert err["field"] == control


BAD_PLAN = [
    ("tokens_per_update", "0", "not a positive whole number"),
    ("target", "deepspeed", "unknown value 'deepspeed'"),
    ("time_limit", "0", "outside (0, 600]"),
    ("time_limit", "100000", "outside (0, 600]"),
    ("time_limit", "soon", "not a number"),
    ("top", "500", "at most 20"),
    ("top", "1.5", "not a positive whole number"),
    ("mtp_layers", "2", "exceeds the 0 MTP layers of qwen3-30b-a3b"),
]


@pytest.mark.parametrize(("control", "value", "words"), BAD_PLAN, ids=[f"{c}={v}" for c, v, _ in BAD_PLAN])
def test_every_plan_control_has_one_line_beside_it(client: TestClient, control: str, value: str, words: str) -> None:
    r = client.post("/api/plans", json={**SMALL_JOB, control: value})
    assert r.status_code == 400 and words in r.json()["error"] and r.json()["field"] == control


def test_malformed_requests_get_one_line_and_the_server_goes_on(client: TestClient, default: dict) -> None:
    for r in (client.post("/api/evaluate", content=b"{not json", headers={"Content-Type": "application/json"}),
              client.post("/api/evaluate", json=[1, 2]),
              client.post("/api/download/pdf", json=default),
              client.get("/api/plans/p999999"),
              client.get("/api/plans/p999999/csv")):
        assert r.status_code == 400 and r.json()["error"] and "\n" not in r.json()["error"]
    assert client.post("/api/evaluate", json=default).status_code == 200


# ------------------------------------------------------------------------------------------------- the command


def test_k3opt_serve_starts_and_answers(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "k3opt.cli", "serve", "--port", str(port)],
                            stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/options", timeout=2) as r:
                    assert r.status == 200 and b"kimi-k3" in r.read()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < end, "k3opt serve did not come up"
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
            assert b"k3opt planning lab" in r.read()
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize(("args", "words"), [
    (["--port", "70000"], "70000"),
    (["--sweep", "no-such.csv"], "does not exist"),
    (["--sweep", "{bad}"], "a sweep output is .csv or .parquet"),
])
def test_serve_bad_options_get_one_line_and_exit_2(tmp_path: Path, args: list[str], words: str) -> None:
    bad = tmp_path / "sweep.txt"
    bad.write_text("x")
    args = [a.replace("{bad}", str(bad)) for a in args]
    res = CliRunner().invoke(main, ["serve", *args])
    errors = [ln for ln in res.output.splitlines() if ln.startswith(("Error:", "k3opt:"))]
    assert res.exit_code == 2 and len(errors) == 1 and words in errors[0]


def test_the_fp8_weights_control_round_trips_and_prices_as_evaluate(client: TestClient) -> None:
    """MB-13's MXFP8 weights stored only in MXFP8 (its recipe's fp8_param_gather): the explorer loads the control on
    and prices the layout as evaluate() does; off, the worst rank holds the BF16 copies too, as the layout without the
    field does."""
    from k3opt.serve.views import form_of

    lay = load_layout("mb-13-deepseek-v3-gb200")
    form = form_of(lay, lay.runtime)
    assert form["fp8_param_gather"] == "on"
    on = client.post("/api/evaluate", json=form).json()
    off = client.post("/api/evaluate", json={**form, "fp8_param_gather": "off"}).json()
    assert on["form"]["fp8_param_gather"] == "on" and off["form"]["fp8_param_gather"] == "off"
    bf16 = k3opt.evaluate(lay.model_copy(update={"fp8_param_gather": False}))
    assert on["view"]["summary"]["rank_time_s"] == pytest.approx(k3opt.evaluate(lay).step.rank_time_s, rel=1e-12)
    assert off["view"]["summary"]["peak_gib"] == pytest.approx(bf16.peak_bytes / 2**30, rel=1e-9)
    assert on["view"]["summary"]["peak_gib"] < off["view"]["summary"]["peak_gib"]
    bad = client.post("/api/evaluate", json={**form, "precision": "bf16"})
    assert "fp8_param_gather" in bad.text
