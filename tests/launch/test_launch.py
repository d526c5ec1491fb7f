"""Launch export (Megatron-LM, Megatron-Bridge, torchtitan) and the frameworks' limits as search constraints.

Expected values come from the model shapes and the seed-000 reference batch, and from independent
re-implementations of the frameworks' own rules (Megatron's layout grammar, torchtitan's mesh sizes).
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import MEASURED

import k3opt
from k3opt.cli import main
from k3opt.inputs.errors import SpecError, UnknownTargetError
from k3opt.inputs.frameworks import MEGATRON_LM_COMMIT
from k3opt.inputs.specs import TOGGLE_NAMES, Dtype, FsdpLifecycle, Recompute
from k3opt.launch import FORMATS, LIMITS, NO_SWITCH, apply_target_limits, launch_refusals, refusals, to_launch
from k3opt.search.frames import frame_of

DATA = Path(__file__).parents[1] / "data"
ROOT = Path(__file__).parents[2]
FLAGS_FILE = DATA / "megatron_lm_flags.txt"
# The default plan's layout (k3opt plan --top 1 on the k3-512-4k job).
DEFAULT = {
    "gpus": 512, "pp": 8, "vp": 1, "cp": 1, "ep": 64, "expert_fsdp": 1, "dense_fsdp": 64, "microbatches": 64,
    "rows": 1, "context": 4096, "split": [9, 9, 10, 11, 12, 14, 14, 14], "recompute": "selective",
    "fsdp_lifecycle": "per_microbatch", "reserve_gib": 4.0, "domain_gpus_used": 64, "model": "kimi-k3",
    "toggles": {"fp8_activations": True, "moe_backward_rewrite": True, "dispatch_recompute": True,
                "fused_situ": True},
}
ALL_ON = {t: True for t in TOGGLE_NAMES}


def _layout(**over) -> k3opt.Layout:  # noqa: ANN003
    return k3opt.make_layout(**{**DEFAULT, **over})


def _variants() -> list[k3opt.Layout]:
    """Layouts that between them reach every switch the Megatron export can emit."""
    return [
        _layout(),
        _layout(recompute="full", fsdp_lifecycle="accumulate", toggles=ALL_ON),
        _layout(recompute="none", toggles={"activation_offload": True, "ep_dedup": True}),
        _layout(vp=2, microbatches=64, split=[6] * 15 + [3], toggles={}),
        _layout(fp8_block_size=32, toggles={"fp8_activations": True}),
    ]


def _megatron_flags(text: str) -> list[str]:
    """Every --flag on a non-comment line of a Megatron-LM export."""
    return [tok for line in text.splitlines() if not line.lstrip().startswith("#")
            for tok in line.split() if tok.startswith("--")]


def _expand_layout(s: str) -> list[str]:
    """Megatron's PipelineParallelLayerLayout.parse_str_to_list, re-implemented from its description: drop
    commas, expand (X)*n, then c*n (one character), split on '|'."""
    s = s.replace(",", "")
    s = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    s = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    return s.split("|")


# ------------------------------------------------------------------------------------ Megatron-LM


def test_flag_file_names_its_commit():
    head = [ln for ln in FLAGS_FILE.read_text().splitlines() if ln.startswith("#")]
    assert any("NVIDIA/Megatron-LM" in ln and MEGATRON_LM_COMMIT in ln for ln in head)
    flags = {ln for ln in FLAGS_FILE.read_text().splitlines() if ln and not ln.startswith("#")}
    # The launch-flags notes count about 400 literal add_argument flags and about 465 generated ones at d98e8a64.
    assert 800 < len(flags) < 950
    # Fields the notes list as excluded from the command line must not be there.
    assert "--cpu-offloading" not in flags and "--fp8-dot-product-attention" not in flags
    assert "--virtual-pipeline-model-parallel-size" not in flags


@pytest.mark.parametrize("layout", _variants(), ids=lambda lay: f"pp{lay.pp}v{lay.vp}-{lay.recompute.value}")
def test_every_emitted_megatron_lm_flag_is_defined(layout):
    defined = {ln for ln in FLAGS_FILE.read_text().splitlines() if ln and not ln.startswith("#")}
    emitted = _megatron_flags(to_launch(layout, "megatron-lm").text)
    assert emitted, "no flags emitted"
    assert sorted(set(emitted) - defined) == []


def test_variants_reach_every_megatron_switch():
    emitted = set()
    for lay in _variants():
        emitted |= set(_megatron_flags(to_launch(lay, "megatron-lm").text))
    for flag in ("--fp8-format", "--fp8-recipe", "--fine-grained-activation-offloading", "--offload-modules",
                 "--moe-flex-dispatcher-backend", "--recompute-method", "--recompute-modules",
                 "--accumulate-allreduce-grads-in-fp32", "--pipeline-model-parallel-layout"):
        assert flag in emitted


def test_megatron_layout_has_the_exact_per_stage_counts():
    text = to_launch(_layout(), "megatron-lm").text
    value = re.search(r"--pipeline-model-parallel-layout '([^']+)'", text).group(1)
    stages = _expand_layout(value)
    assert [s.count("t") for s in stages] == [9, 9, 10, 11, 12, 14, 14, 14]
    assert stages[0].startswith("E") and stages[-1].endswith("L")
    assert "".join(stages).count("E") == 1 and "".join(stages).count("L") == 1


def test_interleaved_layout_stage_i_runs_on_rank_i_mod_pp():
    lay = _layout(vp=2, split=[5, 6, 7, 8, 4, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 3], toggles={})
    value = re.search(r"--pipeline-model-parallel-layout '([^']+)'",
                      to_launch(lay, "megatron-lm").text).group(1)
    stages = _expand_layout(value)
    assert len(stages) == 16  # 2 virtual stages per rank: Megatron sets VPP = 16 / PP8 = 2
    # k3opt's chunk j runs on rank j mod p, Megatron's stage i on pp_rank i % PP: same list, same order.
    assert [s.count("t") for s in stages] == lay.split


def test_megatron_batch_flags_from_the_reference_batch():
    text = to_launch(_layout(), "megatron-lm").text
    # Seed 000: 16,777,216 tokens per update at 4096 tokens per sequence = 4096 sequences; DP = 512 / 8 = 64,
    # so M = 4096 / (1 x 64) = 64.
    assert "--global-batch-size 4096" in text and "--micro-batch-size 1" in text
    assert "--seq-length 4096" in text
    assert "--moe-layer-freq '[0]+[1]*92'" in text  # layer 0 is the one dense-FFN layer of 93


def test_megatron_lm_lists_what_has_no_switch():
    launch = to_launch(_layout(), "megatron-lm")
    decisions = " ".join(m.decision for m in launch.missing)
    # The default plan's toggles without a Megatron switch, the KDA layers, the per-microbatch lifecycle.
    for word in ("moe_backward_rewrite", "dispatch_recompute", "fused_situ", "KDA", "per_microbatch"):
        assert word in decisions
    for m in launch.missing:
        assert f"# {m.line()}" in launch.text
    # A switch that exists is not listed as missing.
    assert "fp8_activations" not in decisions


# ------------------------------------------------------------------------------------ Megatron-Bridge


def test_bridge_overrides_carry_kda_layers_and_the_layout():
    launch = to_launch(_layout(), "megatron-bridge")
    keys = dict(launch.settings)
    # K3: 93 layers, full attention at i % 4 == 3 for i < 92 plus i = 92 (24 layers) -> 69 KDA layers,
    # 1-indexed for Bridge: 1, 2, 3, 5, 6, 7, 9, ..., 91 (layer 92 (0-based), number 93, is MLA).
    kda = [int(x) for x in keys["model.kimi_kda_layers"].strip("[]").split(",")]
    assert len(kda) == 69 and kda[:4] == [1, 2, 3, 5] and kda[-1] == 91 and 4 not in kda
    stages = _expand_layout(keys["model.pipeline_model_parallel_layout"].strip('"'))
    assert [s.count("t") for s in stages] == DEFAULT["split"]
    for prefix in ("model.", "ddp.", "optimizer.", "mixed_precision.", "train."):
        assert any(k.startswith(prefix) for k in keys)
    assert keys["train.global_batch_size"] == "4096"
    assert "KDA" not in " ".join(m.decision for m in launch.missing)


def test_bridge_refusals_are_listed_in_the_export():
    launch = to_launch(_layout(vp=2, cp=2, dense_fsdp=32, split=[6] * 15 + [3], toggles={}), "megatron-bridge")
    decisions = [m.decision for m in launch.missing]
    assert "vp = 2" in decisions and "cp = 2" in decisions


@pytest.mark.parametrize("layout", _variants(), ids=lambda lay: f"pp{lay.pp}v{lay.vp}-{lay.recompute.value}")
def test_every_emitted_bridge_key_is_a_config_field(layout):
    text = (DATA / "megatron_bridge_keys.txt").read_text()
    assert "067f987df03b8355b03192d88d70f1709fedf51a" in text and MEGATRON_LM_COMMIT in text
    defined = {ln for ln in text.splitlines() if ln and not ln.startswith("#")}
    emitted = [k for k, _ in to_launch(layout, "megatron-bridge").settings]
    assert "model.kimi_kda_layers" in emitted
    assert sorted(set(emitted) - defined) == []


# ------------------------------------------------------------------------------------ torchtitan


def test_torchtitan_toml_sections():
    lay = _layout(cp=2, dense_fsdp=32, ep=32, expert_fsdp=2, microbatches=128)
    cfg = tomllib.loads(to_launch(lay, "torchtitan").body)
    par = cfg["parallelism"]
    # FSDP mesh dp_shard x cp = dense_fsdp 32 -> dp_shard 16; the 512 / 8 = 64 stage ranks = replicate x 16 x 2:
    # replicate 2.
    assert par["data_parallel_shard_degree"] == 16 and par["data_parallel_replicate_degree"] == 2
    assert par["context_parallel_degree"] == 2 and par["expert_parallel_degree"] == 32
    parts = par["module_fqns_per_model_part"]
    assert [sum(n.startswith("layers.") for n in p) for p in parts] == DEFAULT["split"]
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    # DP = 512 / (8 x 2) = 32 ranks; M = 128 microbatches of 1 row: 128 per DP rank, 4096 sequences per update.
    assert cfg["training"] == {"local_batch_size": 128, "global_batch_size": 4096, "seq_len": 4096}
    assert cfg["activation_checkpoint"]["mode"] == "selective"


def _toml_keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += _toml_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]
    return out


@pytest.mark.parametrize("layout", _variants(), ids=lambda lay: f"pp{lay.pp}v{lay.vp}-{lay.recompute.value}")
def test_every_emitted_torchtitan_key_is_defined(layout):
    text = (DATA / "torchtitan_keys.txt").read_text()
    assert "e347b1e5e6b6941d789d16d340145294d82dc71e" in text
    defined = {ln for ln in text.splitlines() if ln and not ln.startswith("#")}
    emitted = _toml_keys(tomllib.loads(to_launch(layout, "torchtitan").body))
    assert emitted and sorted(set(emitted) - defined) == []


# ------------------------------------------------------------------------------------ every format, CLI


@pytest.mark.parametrize("fmt", FORMATS)
def test_cli_export_writes_file_and_lists_missing_on_stderr(tmp_path, fmt):
    out = tmp_path / "launch.txt"
    layout = tmp_path / "lay.toml"
    layout.write_text(to_toml(_layout()))
    res = CliRunner().invoke(main, ["export", str(layout), "--format", fmt, "--out", str(out)])
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert "NO SWITCH: toggle moe_backward_rewrite" in text
    assert "NO SWITCH: toggle moe_backward_rewrite" in res.stderr


def to_toml(lay: k3opt.Layout) -> str:
    data = lay.model_dump(mode="json", exclude_none=True)
    toggles = data.pop("toggles")
    # JSON scalars and lists of numbers are valid TOML values (true/false, numbers, quoted strings).
    lines = [f"{k} = {json.dumps(v)}" for k, v in data.items() if not isinstance(v, dict)]
    lines += ["[toggles]"] + [f"{k} = {json.dumps(v)}" for k, v in toggles.items()]
    return "\n".join(lines) + "\n"


def test_unknown_format_is_one_line_exit_2():
    res = CliRunner().invoke(main, ["export", "k3-gb200-512-reference", "--format", "deepspeed"])
    assert res.exit_code == 2
    assert res.stderr.strip().count("\n") == 0 and "megatron-bridge" in res.stderr
    with pytest.raises(UnknownTargetError):
        to_launch(_layout(), "deepspeed")
    with pytest.raises(UnknownTargetError):
        launch_refusals(_layout(), "nemo")


def test_unknown_job_target_is_a_spec_error(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('gpus = 512\ntokens_per_update = 16777216\ntarget = "deepspeed"\n')
    with pytest.raises(SpecError, match="target"):
        k3opt.load_job(job)
    res = CliRunner().invoke(main, ["plan", str(job)])
    assert res.exit_code == 2 and "target" in res.stderr and "Traceback" not in res.output


# ------------------------------------------------------------------------------------ limits


def test_every_limit_names_a_file_and_a_commit():
    for lim in LIMITS:
        assert lim.target in FORMATS
        assert re.search(r"\.py\b", lim.source) and re.search(r"\b[0-9a-f]{8}\b", lim.source), lim
    for target, table in NO_SWITCH.items():
        for ns in table:
            assert ns.toggle in TOGGLE_NAMES, (target, ns.toggle)
            assert re.search(r"\b[0-9a-f]{8}\b", ns.source)


def test_job_target_names_the_export_formats():
    import typing

    ann = k3opt.Job.model_fields["target"].annotation
    literal = next(a for a in typing.get_args(ann) if a is not type(None))
    assert set(typing.get_args(literal)) == set(FORMATS)


def test_apply_target_limits_narrows_the_search(model):
    job = k3opt.load_job("k3-512-4k").model_copy(update={"target": "megatron-bridge"})
    narrowed = apply_target_limits(job, model).search
    assert narrowed.vp == [1] and narrowed.cp == [1]
    assert narrowed.fsdp_lifecycle == [FsdpLifecycle.ACCUMULATE]
    assert {ns.toggle for ns in NO_SWITCH["megatron-bridge"]} <= set(narrowed.forbid_toggles)
    # Toggles with a Megatron switch stay searchable.
    assert not {"fp8_activations", "activation_offload", "ep_dedup"} & set(narrowed.forbid_toggles)
    untouched = k3opt.load_job("k3-512-4k")
    assert apply_target_limits(untouched, model) == untouched


def test_bridge_s_vp_and_cp_limits_are_kimi_k3_s_only():
    """build_kimi_k3_spec and KimiK3Attention raise on VP > 1 and (KDA) CP > 1; Bridge's DeepSeek-V3 and Qwen3
    recipes run VP 4 and VP 3 (perf_recipes at 067f987d): their jobs keep VP and CP, their layouts are not refused
    and their exports name no missing switch for it."""
    ds = k3opt.load_model("deepseek-v3")
    job = k3opt.load_job("k3-512-4k").model_copy(update={"target": "megatron-bridge", "model": "deepseek-v3"})
    narrowed = apply_target_limits(job, ds).search
    assert narrowed.vp is None and narrowed.cp is None
    lay = k3opt.load_layout("deepseek-v3-gb200-mxfp8-paged-stash")
    assert not [why for why in launch_refusals(lay, "megatron-bridge", ds) if "vp" in why]
    assert not [m for m in to_launch(lay, "megatron-bridge").missing if m.decision.startswith("vp")]
    k3 = k3opt.load_model("kimi-k3")
    assert [why for why in launch_refusals(_layout(vp=2, microbatches=64, split=[6] * 15 + [3]), "megatron-bridge",
                                           k3) if "vp" in why]


def test_torchtitan_runs_no_offload_modules(model):
    """Core torchtitan offloads no activations: a job's offload sets are dropped for it (and kept for Megatron), and
    a layout that offloads by module is refused, unless that limit is lifted to price it."""
    job = k3opt.load_job("k3-512-4k").model_copy(update={"target": "torchtitan"})
    job = job.model_copy(update={"search": job.search.model_copy(update={"offload_modules": [["moe_act"]]})})
    assert apply_target_limits(job, model).search.offload_modules == []
    assert apply_target_limits(job, model, frozenset({"offload_modules"})).search.offload_modules == [["moe_act"]]
    bridge = job.model_copy(update={"target": "megatron-bridge"})
    assert apply_target_limits(bridge, model).search.offload_modules == [["moe_act"]]
    lay = _layout(fsdp_lifecycle="accumulate", recompute="selective", toggles={}, offload_modules=["moe_act"])
    assert [k for k, _ in refusals(lay, "torchtitan", model)].count("offload_modules") == 1
    assert "offload_modules" not in [k for k, _ in refusals(lay, "megatron-lm", model)]


def test_torchtitan_runs_bf16_mxfp8_and_per_tensor_fp8_only_without_routed_experts(model):
    """torchtitan at the pinned TOML commit: MX converters for BF16's MXFP8 (linear and grouped GEMM), a Float8Linear
    'tensorwise' recipe for the linears (job_config.py L738), but an FP8 grouped GEMM that scales row-wise and asserts
    pipeline degree 1 (float8.py L176-208), and no NVFP4 converter. A K3 job (routed experts) keeps BF16 and MXFP8 of
    its precisions; Llama 3 70B (no routed experts) keeps per-tensor FP8 too; a lifted limit or another target
    keeps them all."""
    k3 = k3opt.Job.model_validate({**k3opt.load_job("k3-512-4k").model_dump(), "target": "torchtitan",
                                   "precisions": ["bf16", "fp8", "mxfp8", "nvfp4"]})
    assert [p.value for p in apply_target_limits(k3, model).precisions] == ["bf16", "mxfp8"]
    assert apply_target_limits(k3, model, frozenset({"precision"})).precisions == k3.precisions
    bridge = k3.model_copy(update={"target": "megatron-bridge"})
    assert apply_target_limits(bridge, model).precisions == k3.precisions
    llama = k3opt.load_model("llama3-70b")
    dense = k3.model_copy(update={"model": "llama3-70b"})
    assert [p.value for p in apply_target_limits(dense, llama).precisions] == ["bf16", "fp8", "mxfp8"]
    only_fp8 = k3opt.Job.model_validate({**k3.model_dump(), "precisions": ["fp8", "nvfp4"]})
    with pytest.raises(k3opt.InfeasibleJobError, match=r"^precisions \['fp8', 'nvfp4'\] leave none target "
                                                        r"torchtitan runs .*add \"bf16\" or \"mxfp8\""):
        apply_target_limits(only_fp8, model)
    ids = {p: [k for k, _ in refusals(_layout(precision=p), "torchtitan", model)] for p in ("fp8", "mxfp8", "nvfp4")}
    assert ids["fp8"].count("precision") == ids["nvfp4"].count("precision") == 1 and "precision" not in ids["mxfp8"]
    assert "precision" not in [k for k, _ in refusals(_layout(precision="fp8"), "megatron-lm", model)]


def test_torchtitan_exports_each_precision_with_its_converter_or_names_it_missing():
    """MXFP8: the MX converters; per-tensor FP8 on a model without routed experts: Float8Linear with the 'tensorwise'
    recipe (every key defined at the pinned commit); on K3, or NVFP4 anywhere: listed as missing."""
    mx = to_launch(_layout(precision="mxfp8", toggles={}), "torchtitan")
    assert tomllib.loads(mx.body)["model"]["converters"] == ["quantize.linear.mx", "quantize.grouped_mm.mx"]
    assert not [m for m in mx.missing if "precision" in m.decision]
    for lay in (_layout(precision="fp8"), _layout(precision="nvfp4")):
        out = to_launch(lay, "torchtitan")
        assert [m.decision for m in out.missing if "precision" in m.decision] == [
            f'precision = "{lay.precision.value}"']
    llama = k3opt.load_layout(str(MEASURED / "mb-1-llama3-70b-gb300.toml"))
    assert llama.precision.value == "fp8"
    out = to_launch(llama, "torchtitan")
    cfg = tomllib.loads(out.body)
    assert cfg["model"]["converters"] == ["quantize.linear.float8"]
    assert cfg["quantize"]["linear"]["float8"] == {"recipe_name": "tensorwise"}
    assert not [m for m in out.missing if "precision" in m.decision]
    defined = {ln for ln in (DATA / "torchtitan_keys.txt").read_text().splitlines() if ln and not ln.startswith("#")}
    assert sorted(set(_toml_keys(cfg)) - defined) == []


@pytest.mark.parametrize(("run", "name", "flavor", "optimizer"), [
    # torchtitan e347b1e5: models/llama3/__init__.py L82 "70B"; models/deepseek_v3/__init__.py L130 "671B";
    # models/qwen3/__init__.py L168 "235B-A22B"; no flavor with Kimi K2's 384 experts; job_config.py Optimizer.name.
    ("mb-1-llama3-70b-gb300.toml", "llama3", "70B", "AdamW"),
    ("mb-22-deepseek-v3-gb200.toml", "deepseek_v3", "671B", "AdamW"),
    ("mb-17-qwen3-235b-a22b-gb300.toml", "qwen3", "235B-A22B", "AdamW"),
    ("mb-21-kimi-k2-gb300.toml", "kimi_k2", None, None),
])
def test_torchtitan_names_each_preset_model_and_its_optimizer(run, name, flavor, optimizer):
    """The [model] name and flavor torchtitan builds for each preset, [optimizer] AdamW where the model trains with
    it (Muon listed missing, as for K3); the derived expert sharding degree is listed only for a model with routed
    experts; every key is one the pinned commit defines."""
    lay = k3opt.load_layout(str(MEASURED / run))
    out = to_launch(lay, "torchtitan")
    cfg = tomllib.loads(out.body)
    assert cfg["model"]["name"] == name and cfg["model"].get("flavor") == flavor
    assert cfg.get("optimizer", {}).get("name") == optimizer
    missing = [m.decision for m in out.missing]
    assert any(d.startswith("Muon optimizer") for d in missing) == (optimizer is None)
    assert any(d.endswith(" model") for d in missing) == (flavor is None)
    if run.startswith("mb-1-"):  # Llama 3 70B: no routed experts, nothing derives an expert sharding degree
        assert lay.dense_fsdp != lay.ep * lay.expert_fsdp and not any(d.startswith("expert_fsdp") for d in missing)
    defined = {ln for ln in (DATA / "torchtitan_keys.txt").read_text().splitlines() if ln and not ln.startswith("#")}
    assert sorted(set(_toml_keys(cfg)) - defined) == []


@pytest.mark.parametrize(("run", "recipe"), [
    # Megatron-Bridge 067f987d src/megatron/bridge/recipes/*/__init__.py export these library recipes; none for K3.
    ("mb-1-llama3-70b-gb300.toml", "llama3_70b_pretrain_config"),
    ("mb-22-deepseek-v3-gb200.toml", "deepseek_v3_pretrain_config"),
    ("mb-20-qwen3-30b-a3b-gb200.toml", "qwen3_30b_a3b_pretrain_config"),
    ("mb-18-qwen3-235b-a22b-gb200.toml", "qwen3_235b_a22b_pretrain_config"),
    ("mb-21-kimi-k2-gb300.toml", "kimi_k2_pretrain_config"),
    ("k3-gb200-512-reference.toml", "<your_kimi_k3_recipe>"),
    # The 4-layer K3 proxy has KDA layers: no recipe of its own, built on the Kimi K3 provider all the same.
    ("k3-4layer-dist-muon-8gpu.toml", "<your_kimi_k3_4layer_proxy_recipe>"),
])
def test_megatron_bridge_runs_each_preset_through_its_own_recipe(run, recipe):
    out = to_launch(k3opt.load_layout(str(MEASURED / run)), "megatron-bridge")
    assert out.body.splitlines()[0] == f"python scripts/training/run_recipe.py --recipe {recipe} \\"
    assert any("KimiK3ModelProvider" in n for n in out.notes) == run.startswith("k3-")


def test_a_model_file_reusing_a_preset_name_gets_no_preset_recipe(tmp_path):
    """A model file named `llama3-70b` whose vocabulary differs from the preset's (256,000 against 128,256) is not
    the model Bridge's llama3_70b_pretrain_config or torchtitan's llama3 70B flavor builds: the exports name a
    user recipe and list the flavor missing, as for a model no preset covers."""
    text = (ROOT / "constraints" / "models" / "llama3-70b.toml").read_text()
    changed = re.sub(r"(?m)^vocab_size = .*$", "vocab_size = 256000", text)
    assert changed != text
    path = tmp_path / "llama3-70b.toml"
    path.write_text(changed)
    lay = k3opt.load_layout(str(MEASURED / "mb-1-llama3-70b-gb300.toml")).model_copy(update={"model": str(path)})
    bridge = to_launch(lay, "megatron-bridge")
    assert bridge.body.splitlines()[0] == "python scripts/training/run_recipe.py --recipe <your_llama3_70b_recipe> \\"
    titan = to_launch(lay, "torchtitan")
    assert "flavor" not in tomllib.loads(titan.body)["model"]
    assert "llama3-70b model" in [m.decision for m in titan.missing]


def test_torchtitan_lists_bf16_adamw_moments_as_missing():
    """MB-22 (DeepSeek-V3 25.11) keeps its AdamW moments in BF16, which torchtitan's AdamW (FP32 moments, those of
    its FP32 parameters) cannot; the same layout at FP32 moments lists nothing about them."""
    lay = k3opt.load_layout(str(MEASURED / "mb-22-deepseek-v3-gb200.toml"))
    assert lay.optimizer_state_dtype is None or lay.optimizer_state_dtype.value == "bf16"
    bf16 = [m.decision for m in to_launch(lay, "torchtitan").missing]
    at_fp32 = lay.model_copy(update={"optimizer_state_dtype": Dtype.FP32})
    fp32 = [m.decision for m in to_launch(at_fp32, "torchtitan").missing]
    assert "AdamW moments in BF16" in bf16 and "AdamW moments in BF16" not in fp32


def test_cli_plan_with_torchtitan_and_only_per_tensor_fp8_on_an_moe_model_exits_2(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(
        f'model = "{DATA / "tiny-moe.toml"}"\ncluster = "{DATA / "slow-cluster.toml"}"\ngpus = 8\ncontext = 2048\n'
        'tokens_per_update = 32768\nreserve_gib = 1.5\nprecisions = ["fp8"]\ntarget = "torchtitan"\n'
        '[search]\npp = [2]\nep = [2]\ndense_fsdp = [2]\nexpert_fsdp = [1]\nvp = [1]\nrecompute = ["full"]\n')
    res = CliRunner().invoke(main, ["plan", str(job), "--top", "1", "--time-limit", "20"])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "precisions ['fp8'] leave none target torchtitan runs" in lines[0]


def test_launch_refusals(model):
    ok = _layout(fsdp_lifecycle="accumulate", toggles={"fp8_activations": True})
    assert launch_refusals(ok, "megatron-bridge", model) == []
    bad = _layout(vp=2, split=[6] * 15 + [3], ep=32, fsdp_lifecycle="accumulate", toggles={})
    reasons = launch_refusals(bad, "megatron-bridge", model)
    assert any(r.startswith("vp = 2") for r in reasons)
    # dense_fsdp 64 != ep 32 x expert_fsdp 1: Megatron derives the expert shard degree (it would be 2).
    assert any("dense_fsdp 64 != ep x expert_fsdp = 32 x 1" in r for r in reasons)
    assert any("moe_backward_rewrite" in r for r in launch_refusals(_layout(), "torchtitan", model))
    # Megatron's interleaved schedule: M = 60 leaves a last group of 60 mod 8 = 4 < PP8 microbatches, which no
    # framework runs: such a layout cannot be built at all.
    with pytest.raises(k3opt.LayoutError, match=r"microbatches \(60\) must be a multiple of pp \(8\)"):
        _layout(vp=2, split=[6] * 15 + [3], microbatches=60, fsdp_lifecycle="accumulate", toggles={})


def test_target_job_never_returns_a_refused_layout():
    """A tiny model where the unconstrained best layouts break Megatron-Bridge's rules; with the target set,
    every returned layout is one Bridge can run."""
    tiny = k3opt.load_model(DATA / "tiny-moe.toml")
    slow = k3opt.load_cluster(DATA / "slow-cluster.toml")
    spec = {
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "rows": 1, "tokens_per_update": 32768, "reserve_gib": 1.5,
        "search": {"pp": [2], "vp": [1, 2], "cp": [1, 2], "ep": [2, 4], "expert_fsdp": [1, 2],
                   "dense_fsdp": [1, 2], "recompute": ["full"],
                   "forbid_toggles": [t for t in TOGGLE_NAMES if t not in ("fused_situ", "fp8_activations")]},
    }
    free = k3opt.plan(k3opt.Job.model_validate(spec), model=tiny, cluster=slow, top=3)
    assert any(launch_refusals(it.layout, "megatron-bridge", tiny) for it in free.layouts)
    bound = k3opt.plan(k3opt.Job.model_validate({**spec, "target": "megatron-bridge"}), model=tiny, cluster=slow,
                       top=3)
    assert bound.layouts
    for it in bound.layouts:
        assert launch_refusals(it.layout, "megatron-bridge", tiny) == []
        assert it.layout.recompute == Recompute.FULL
    assert bound.layouts[0].rank_time_s >= free.layouts[0].rank_time_s
    # OPTIMAL within the default 1% gap among runnable layouts: the bound never above the best returned.
    assert bound.bound <= bound.layouts[0].rank_time_s
    assert bound.status != "OPTIMAL" or bound.gap <= 0.01 + 1e-12


def test_a_target_search_ranks_only_the_shapes_the_target_can_run():
    """The degree rules (k3opt.launch.degree_refusals: the derived expert sharding degree dense_fsdp = ep x
    expert_fsdp here, on the tiny MoE model) are applied to the shapes before the search, not to its ranked
    layouts after: the plan counts only the shapes that keep them, and with a top large enough to rank every
    shape, each kept shape's layout comes back (none is lost to a filter after the search)."""
    from k3opt.search.frames import enumerate_frames

    tiny = k3opt.load_model(DATA / "tiny-moe.toml")
    slow = k3opt.load_cluster(DATA / "slow-cluster.toml")
    spec = {
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "rows": 1, "tokens_per_update": 32768, "reserve_gib": 1.5, "target": "torchtitan",
        "search": {"pp": [2], "vp": [1], "cp": [1], "ep": [2, 4], "expert_fsdp": [1, 2], "dense_fsdp": [1, 2, 4],
                   "recompute": ["full"], "dense_sharding": ["optim"], "expert_sharding": ["optim"],
                   "forbid_toggles": list(TOGGLE_NAMES)},
    }
    job = k3opt.Job.model_validate(spec)
    every = enumerate_frames(job, tiny, 8, slow)
    # By hand: at PP2 on 8 GPUs the data-parallel group is 4; dense_fsdp = ep x expert_fsdp keeps (ep 2, efsdp 1,
    # dfsdp 2), (ep 2, efsdp 2, dfsdp 4) and (ep 4, efsdp 1, dfsdp 4) of the degree combinations.
    kept = [f for f in every if (f.ep, f.expert_fsdp, f.dense_fsdp) in {(2, 1, 2), (2, 2, 4), (4, 1, 4)}]
    assert len(kept) == 3 < len(every)
    plan = k3opt.plan(job, model=tiny, cluster=slow, top=len(every), gap=0)
    assert plan.frames_total == len(kept)
    assert {frame_of(it.layout) for it in plan.layouts} <= set(kept)
    assert all(launch_refusals(it.layout, "torchtitan", tiny) == [] for it in plan.layouts)


def test_a_target_job_whose_every_shape_is_refused_gets_one_line():
    tiny = k3opt.load_model(DATA / "tiny-moe.toml")
    slow = k3opt.load_cluster(DATA / "slow-cluster.toml")
    job = k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 1.5, "target": "torchtitan",
        "search": {"pp": [2], "ep": [4], "expert_fsdp": [1], "dense_fsdp": [1]}})
    with pytest.raises(k3opt.InfeasibleJobError, match=r"every parallel shape of the job is refused, e\.g\. PP2 .*"
                                                        r"dense_fsdp 1 != ep x expert_fsdp = 4 x 1"):
        k3opt.plan(job, model=tiny, cluster=slow, top=1)


def test_cli_plan_with_target_exports_and_shows_the_cost(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(
        f'model = "{DATA / "tiny-moe.toml"}"\ncluster = "{DATA / "slow-cluster.toml"}"\ngpus = 8\ncontext = 2048\n'
        'tokens_per_update = 32768\nreserve_gib = 1.5\n[search]\npp = [2]\nep = [2]\ndense_fsdp = [2]\n'
        'expert_fsdp = [1]\nvp = [1, 2]\nrecompute = ["full"]\n')
    out = tmp_path / "launch.sh"
    res = CliRunner().invoke(main, ["plan", str(job), "--top", "1", "--target", "megatron-bridge",
                                    "--export", "megatron-lm", "--save", "1", str(out)])
    assert res.exit_code == 0, res.output
    assert "launch target megatron-bridge: best" in res.output and "the limits cost" in res.output
    flags = _megatron_flags(out.read_text())
    defined = {ln for ln in FLAGS_FILE.read_text().splitlines() if ln and not ln.startswith("#")}
    assert flags and set(flags) <= defined
    assert "NO SWITCH" in res.stderr  # K3-style KDA layers have no Megatron-LM switch
    res = CliRunner().invoke(main, ["plan", str(job), "--export", "nemo"])
    assert res.exit_code == 2 and "unknown launch format" in res.stderr


def _tiny_target_job(target: str = "torchtitan") -> k3opt.Job:
    return k3opt.Job.model_validate({
        "model": str(DATA / "tiny-moe.toml"), "cluster": str(DATA / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 1.5, "target": target,
        "search": {"pp": [2], "vp": [1], "ep": [2, 4], "expert_fsdp": [1, 2], "dense_fsdp": [2, 4],
                   "recompute": ["full"], "forbid_toggles": list(TOGGLE_NAMES)}})


def test_the_target_cost_line_never_prints_a_negative_cost():
    """Each search stops within its gap: Llama 3 70B at 16K on 128 GB300 with the Bridge target ends at 22.196 s
    with the limits and 22.199 s without. That is no measurable cost, not -0.003 s. A real cost keeps its sign and
    share: 35.905 s against 21.072 s is +14.833 s, 35.905 / 21.072 - 1 = +70.4%."""
    from k3opt.cli import target_cost_line
    none = target_cost_line("megatron-bridge", 22.196, 22.199, "PP1", 0.01)
    assert "cost nothing it can measure" in none and "within 1% of its bound" in none and "-0.003" not in none
    # A search its time limit cut (3.50% above its bound) proves no 1%: the line names the gaps it ended at.
    cut = target_cost_line("megatron-bridge", 12.022, 12.315, "PP4", 0.01, (0.035, 0.004))
    assert "within 1%" not in cut and "3.50%" in cut and "0.40%" in cut and "--time-limit" in cut
    real = target_cost_line("megatron-bridge", 35.905, 21.072, "PP8", 0.01)
    assert real.endswith("the limits cost +14.833 s per step (+70.4%)")


def test_a_pareto_request_with_a_target_searches_once(monkeypatch):
    """The front is a pareto request's answer, and a wider ranked request would start it again with the time that
    is left (DeepSeek-V3 for Megatron-Bridge, 30 s: a front of 1 point from a 0.2-s search): one search."""
    from k3opt import planner

    calls: list[int] = []
    real = planner.search_plan

    def counted(*a, **k):
        calls.append(k["top"])
        return real(*a, **k)

    runnable: list = []

    def one_runnable(lay, *a, **k):  # the first layout asked about runs, no other: a wider request is wanted
        runnable[:] = runnable or [lay]
        return [] if lay == runnable[0] else ["breaks"]

    monkeypatch.setattr(planner, "search_plan", counted)
    monkeypatch.setattr(planner, "launch_refusals", one_runnable)
    tiny = k3opt.load_model(DATA / "tiny-moe.toml")
    slow = k3opt.load_cluster(DATA / "slow-cluster.toml")
    res = k3opt.pareto(_tiny_target_job(), model=tiny, cluster=slow, top=2, time_limit=20, gap=0.0)
    assert res.status == "OPTIMAL" and calls == [2] and res.pareto


def test_a_wider_request_that_does_worse_keeps_the_earlier_answer(monkeypatch):
    """Faked: the first search (OPTIMAL) ranks one runnable layout of the six asked; the wider request, with the
    time left, comes back with none runnable. The plan returns the first search's layout instead of an error."""
    from dataclasses import replace as dc_replace

    from k3opt import planner

    tiny = k3opt.load_model(DATA / "tiny-moe.toml")
    slow = k3opt.load_cluster(DATA / "slow-cluster.toml")
    real = planner.search_plan
    first = real(planner.apply_target_limits(_tiny_target_job(), tiny), model=tiny, cluster=slow, top=1)
    good = first.layouts[0]
    bad_layout = good.layout.model_copy(update={"dense_fsdp": good.layout.ep * good.layout.expert_fsdp * 2})
    calls: list[int] = []

    def fake(*a, **k):
        calls.append(k["top"])
        bad = dc_replace(good, layout=bad_layout)
        if len(calls) == 1:  # all six asked (not exhausted), one runnable
            return dc_replace(first, status="OPTIMAL", layouts=[good] + [bad] * 5)
        return dc_replace(first, status="FEASIBLE", layouts=[bad] * 20)

    monkeypatch.setattr(planner, "search_plan", fake)
    monkeypatch.setattr(planner, "launch_refusals", lambda lay, *a, **k: ["breaks"] if lay is bad_layout else [])
    res = k3opt.plan(_tiny_target_job(), model=tiny, cluster=slow, top=6, time_limit=20)
    assert calls == [6, 24]
    assert res.layouts and res.layouts[0].layout == good.layout


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_export_of_a_measured_layout_writes_a_python_none(fmt):
    """Every measured layout (six model presets) exported: no flag or key carries the text None, a field the model
    does not have (DeepSeek-V3 has no latent MoE: Megatron's --moe-latent-size default is no flag, and
    int('None') would fail its argparse)."""
    for path in sorted(MEASURED.glob("*.toml")):
        out = to_launch(k3opt.load_layout(str(path)), fmt)
        assert [(k, v) for k, v in out.settings if "None" in str(v)] == [], path.name
        assert not [ln for ln in out.body.splitlines() if not ln.lstrip().startswith("#") and "None" in ln], path.name


@pytest.mark.parametrize(("run", "heads", "groups", "qk_norm"), [
    # Hugging Face configs: Llama 3 70B 64 heads / 8 KV heads, head dim 8192 / 64 = 128; Qwen3-30B-A3B 32 / 4,
    # head_dim 128, with q_norm / k_norm.
    ("mb-1-llama3-70b-gb300.toml", 64, 8, False),
    ("mb-20-qwen3-30b-a3b-gb200.toml", 32, 4, True),
])
def test_megatron_exports_write_grouped_query_attention(run, heads, groups, qk_norm):
    lay = k3opt.load_layout(str(MEASURED / run))
    flags = _megatron_flags(to_launch(lay, "megatron-lm").body)
    text = to_launch(lay, "megatron-lm").body
    assert f"--num-attention-heads {heads}" in text and f"--num-query-groups {groups}" in text
    assert "--kv-channels 128" in text and "--group-query-attention" in flags
    assert ("--qk-layernorm" in flags) == qk_norm and "--multi-latent-attention" not in flags
    defined = {ln for ln in FLAGS_FILE.read_text().splitlines() if ln and not ln.startswith("#")}
    assert sorted(set(flags) - defined) == []
    bridge = dict(to_launch(lay, "megatron-bridge").settings)
    assert (bridge["model.num_attention_heads"], bridge["model.num_query_groups"]) == (str(heads), str(groups))
    assert bridge["model.kv_channels"] == "128" and ("model.qk_layernorm" in bridge) == qk_norm


def test_torchtitan_block_size_note_only_where_k3opt_priced_the_block():
    """fp8_block_size prices the FP8 activation toggle's scales under BF16 compute; MXFP8 compute prices its own 1x32
    scales (coefficients.saved_per_token), so only the BF16 layout with 1x128 blocks gets the note."""
    bf16 = to_launch(_layout(toggles={"fp8_activations": True}), "torchtitan")
    mx = to_launch(_layout(precision="mxfp8", toggles={"fp8_activations": True}), "torchtitan")
    assert any("fp8_block_size = 32" in n for n in bf16.notes)
    assert not any("fp8_block_size" in n for n in mx.notes)
