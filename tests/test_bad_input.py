"""Bad input: one clear line naming the field and the rule, exit status 2 from the CLI, a typed exception
from the library, never a traceback."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import k3opt
from k3opt.cli import main

REFERENCE = """
gpus = 512
pp = 8
vp = 1
cp = 1
ep = 64
expert_fsdp = 1
dense_fsdp = 64
microbatches = 64
rows = 1
context = 4096
split = [12, 12, 12, 12, 12, 12, 12, 9]
recompute = "full"
"""


def _write(tmp_path: Path, text: str, name: str = "layout.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _with(**fields: str) -> str:
    lines = [ln for ln in REFERENCE.strip().splitlines() if ln.split(" = ")[0] not in fields]
    lines += [f"{k} = {v}" for k, v in fields.items()]
    return "\n".join(lines) + "\n"


CASES = {
    "malformed_toml": ("gpus = 512\npp = = 8\n", k3opt.SpecError, "not valid TOML"),
    "empty_file": ("   \n", k3opt.SpecError, "empty"),
    "split_wrong_total": (_with(split="[12, 12, 12, 12, 12, 12, 12, 8]"), k3opt.LayoutError, "covers 92 layers"),
    "split_wrong_length": (_with(split="[31, 31, 31]"), k3opt.SpecError, "split has 3 entries"),
    "gpus_not_divisible_by_pp_cp": (_with(gpus="500"), k3opt.SpecError, "divisible by pp * cp"),
    "ep_not_dividing_experts": (_with(gpus="48", ep="3", dense_fsdp="1", split="[12, 12, 12, 12, 12, 12, 12, 9]"),
                                k3opt.LayoutError, "must divide the 896 experts"),
    "ep_not_dividing_stage_ranks": (_with(ep="128"), k3opt.SpecError, "must divide the 64 ranks of a stage"),
    "dense_fsdp_not_dividing": (_with(dense_fsdp="48"), k3opt.SpecError, "dense_fsdp (48) must divide"),
    "expert_fsdp_not_dividing": (_with(expert_fsdp="2"), k3opt.SpecError, "expert_fsdp (2) must divide"),
    "non_positive_size": (_with(microbatches="0"), k3opt.SpecError, "microbatches"),
    "negative_context": (_with(context="-4096"), k3opt.SpecError, "context"),
    "unknown_recompute": (_with(recompute='"some"'), k3opt.SpecError, "recompute"),
    "unknown_toggle": (REFERENCE + "[toggles]\nfp4_activations = true\n", k3opt.SpecError, "unknown key"),
    "unknown_key": (_with(pipeline="8"), k3opt.SpecError, "pipeline: unknown key (remove it or check its spelling)"),
    # Megatron's EP overlap schedule and its delayed weight gradients (specs.ep_overlap_allowed,
    # specs.delay_wgrad_refusal): this PP8 VP1 full-recompute layout can run neither.
    "ep_overlap_on_vp1": (_with(ep_overlap="true"), k3opt.SpecError, "interleaved schedule only"),
    "delay_wgrad_without_overlap": (_with(delay_wgrad_compute="true"), k3opt.SpecError,
                                    "delay_wgrad_compute without ep_overlap"),
    "delay_wgrad_not_bool": (_with(delay_wgrad_compute='"yes"'), k3opt.SpecError, "delay_wgrad_compute"),
    # A key one letter off a field names that field; a toggle one letter off names the toggle.
    "misspelled_key": (_with(microbatch="64"), k3opt.SpecError,
                       "microbatch: unknown key (did you mean 'microbatches'?)"),
    "misspelled_toggle": (REFERENCE + "[toggles]\nfp8_activation = true\n", k3opt.SpecError,
                          "toggles.fp8_activation: unknown key (did you mean 'fp8_activations'?)"),
    "missing_field": ("gpus = 512\n", k3opt.SpecError, "split: required field is missing"),
    # PP8: rank 1 holds chunk 1 only, with 0 layers: it would hold no layer and no edge.
    "pipeline_rank_without_a_layer": (_with(split="[12, 0, 13, 13, 13, 14, 14, 14]"), k3opt.SpecError,
                                      "leaves pipeline rank 1 of 8 without a decoder layer"),
    # 576 GPUs at PP9 VP2 with 64 microbatches: 64 = 7 x 9 + 1 leaves a partial group of one.
    "interleaved_partial_group": (_with(gpus="576", pp="9", vp="2", microbatches="64",
                                        split="[6, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]"),
                                  k3opt.SpecError, "microbatches (64) must be a multiple of pp (9) when vp > 1"),
    # Megatron's interleaved schedule needs pipeline stages (parallel_state.initialize_model_parallel raises).
    "interleaved_without_pipeline": (_with(gpus="64", pp="1", vp="2", split="[46, 47]"), k3opt.SpecError,
                                     "vp (2) needs pp > 1"),
    # CUDA graphs, Megatron's rules (megatron/core/transformer/transformer_config.py @ d98e8a64 __post_init__).
    "cuda_graph_modules_without_impl": (_with(recompute='"selective"', cuda_graph_modules='["attn"]'),
                                        k3opt.SpecError, 'need cuda_graph_impl = "transformer_engine" or "local" '
                                                         '(got none)'),
    "cuda_graph_module_twice": (_with(recompute='"selective"', cuda_graph_impl='"transformer_engine"',
                                      cuda_graph_modules='["attn", "attn"]'),
                                k3opt.SpecError, "cuda_graph_modules lists a module twice; name each once"),
    "cuda_graph_unknown_impl": (_with(cuda_graph_impl='"cudnn"'), k3opt.SpecError, "cuda_graph_impl"),
    "cuda_graph_unknown_module": (_with(recompute='"selective"', cuda_graph_impl='"transformer_engine"',
                                        cuda_graph_modules='["mamba"]'), k3opt.SpecError, "cuda_graph_modules"),
    "cuda_graph_full_iteration_with_modules": (_with(cuda_graph_impl='"full_iteration"', cuda_graph_modules='["attn"]'),
                                               k3opt.SpecError, "requires them empty under full_iteration"),
    "cuda_graph_moe_module": (_with(recompute='"selective"', cuda_graph_impl='"local"', cuda_graph_modules='["moe"]'),
                              k3opt.SpecError, "drop-and-pad MoE only"),
    "cuda_graph_preprocess_without_router": (_with(recompute='"selective"', cuda_graph_impl='"transformer_engine"',
                                                   cuda_graph_modules='["attn", "moe_preprocess"]'),
                                             k3opt.SpecError, "needs 'moe_router' beside it"),
    "cuda_graph_with_full_recompute": (_with(cuda_graph_impl='"transformer_engine"', cuda_graph_modules='["attn"]'),
                                       k3opt.SpecError, "runs full recompute only under a full_iteration graph"),
    # offload_modules: Megatron's fine-grained activation offloading rules (transformer_config.py @ d98e8a64) and
    # modules that hold no saved tensor in the model.
    "offload_unknown_module": (_with(recompute='"selective"', offload_modules='["moe_router"]'), k3opt.SpecError,
                               "offload_modules"),
    "offload_module_twice": (_with(recompute='"selective"', offload_modules='["moe_act", "moe_act"]'),
                             k3opt.SpecError, "offload_modules lists a module twice"),
    "offload_with_full_recompute": (_with(offload_modules='["moe_act"]'), k3opt.SpecError,
                                    "with recompute = \"full\""),
    "offload_with_the_toggle": (_with(recompute='"selective"', offload_modules='["moe_act"]')
                                + "[toggles]\nactivation_offload = true\n", k3opt.SpecError,
                                "the toggle offloads the whole saved set"),
    "offload_attn_proj_alone": (_with(recompute='"selective"', offload_modules='["attn_proj"]'), k3opt.SpecError,
                                "'attn_proj' needs 'core_attn'"),
    "offload_local_graph_attention": (_with(recompute='"selective"', cuda_graph_impl='"local"',
                                            cuda_graph_modules='["attn"]', offload_modules='["core_attn"]'),
                                      k3opt.SpecError, "only expert_fc1 and moe_act beside local graphs"),
    "offload_full_iteration_graph": (_with(recompute='"selective"', cuda_graph_impl='"full_iteration"',
                                           offload_modules='["moe_act"]'), k3opt.SpecError,
                                     "in-flight offload count"),
    "offload_mlp_norm_under_router_graph": (_with(recompute='"selective"', cuda_graph_impl='"transformer_engine"',
                                                  cuda_graph_modules='["moe_router"]', offload_modules='["mlp_norm"]'),
                                            k3opt.SpecError, "turns that offload off in MoE layers"),
    "offload_attn_norm_under_attention_graph": (
        _with(recompute='"selective"', cuda_graph_impl='"transformer_engine"', cuda_graph_modules='["attn"]',
              offload_modules='["attn_norm"]'), k3opt.SpecError,
        "offload_modules 'attn_norm' under an attention CUDA graph: Megatron turns that offload off "
        "(transformer_layer.py L1565-1572); drop it"),
    "offload_beside_layer_offload": (
        _with(gpus="64", pp="1", split="[93]", recompute='"selective"', activation_offload_layers="2",
              offload_modules='["moe_act"]'), k3opt.SpecError,
        "offload_modules ['moe_act'] with activation_offload_layers = 2: Megatron refuses fine-grained offloading "
        "beside cpu_offloading (transformer_config.py L2128-2130); keep one of them"),
    "offload_attn_norm_offloads_nothing": (_with(recompute='"selective"', offload_modules='["attn_norm"]'),
                                           k3opt.LayoutError, "offloads nothing in kimi-k3"),
    "offload_expert_fc1_per_tensor_fp8": (_with(recompute='"selective"', precision='"fp8"',
                                                offload_modules='["expert_fc1"]'), k3opt.LayoutError,
                                          "fc1's BF16 input"),
    # mtp_layers: at most the model's MTP layers (K3 has none), a non-negative integer.
    "mtp_layers_above_the_model": (_with(mtp_layers="1"), k3opt.LayoutError,
                                   "mtp_layers (1) exceeds the 0 MTP layers of kimi-k3: leave mtp_layers out or set 0"),
    "mtp_layers_negative": (_with(mtp_layers="-1"), k3opt.SpecError, "mtp_layers"),
    "mtp_layers_not_an_integer": (_with(mtp_layers='"one"'), k3opt.SpecError, "mtp_layers"),
    # [measured] hardware names the GPU a run ran on: a string.
    "measured_hardware_not_a_string": (REFERENCE + "[measured]\nhardware = 355\n", k3opt.SpecError,
                                       "measured.hardware: Input should be a valid string"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_library_raises_typed_error(tmp_path, case):
    text, exc, fragment = CASES[case]
    path = _write(tmp_path, text)
    with pytest.raises(exc) as info:
        k3opt.evaluate(k3opt.load_layout(path))
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_exits_2_with_one_line(tmp_path, case):
    text, _, fragment = CASES[case]
    path = _write(tmp_path, text)
    result = CliRunner().invoke(main, ["explain", str(path)])
    assert result.exit_code == 2
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("k3opt: error:")
    assert fragment in lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("fields", "what"), [
    ({"cuda_graph_impl": '"local"', "offload_modules": '["expert_fc1", "moe_act"]'},
     "local graphs beside exactly the two expert modules Megatron allows there"),
    ({"cuda_graph_impl": '"transformer_engine"', "cuda_graph_modules": '["moe_router"]',
      "offload_modules": '["attn_norm"]'}, "attn_norm under graphs that leave attention eager"),
    ({"cuda_graph_impl": '"transformer_engine"', "cuda_graph_modules": '["mlp"]', "offload_modules": '["mlp_norm"]'},
     "mlp_norm under graphs of the dense MLP only"),
    ({"offload_modules": '["mlp_norm"]'}, "mlp_norm without graphs"),
    ({"cuda_graph_impl": '"transformer_engine"', "cuda_graph_modules": '["moe_router"]',
      "offload_modules": '["moe_act"]'}, "moe_act under router graphs"),
])
def test_the_offload_rules_accept_what_megatron_runs(tmp_path, fields, what):
    """Megatron's rules refuse only the combinations named in the table above: each of these reads as a layout
    (the model's own checks, such as a norm the TE layer fuses, come with evaluate())."""
    lay = k3opt.load_layout(str(_write(tmp_path, _with(recompute='"selective"', **fields))))
    assert [m.value for m in lay.offload_modules] == json.loads(fields["offload_modules"]), what


def test_unknown_presets(tmp_path):
    with pytest.raises(k3opt.PresetNotFoundError, match="unknown model preset 'kimi-k9'; known presets: .*kimi-k3"):
        k3opt.load_model("kimi-k9")
    with pytest.raises(k3opt.PresetNotFoundError, match="gb200-nvl72"):
        k3opt.load_cluster("gb201")
    result = CliRunner().invoke(main, ["explain", "k3-gb200-512-reference", "--cluster", "tpu-v9"])
    assert result.exit_code == 2 and "unknown cluster preset 'tpu-v9'" in result.output


def test_missing_file(tmp_path):
    with pytest.raises(k3opt.PresetNotFoundError, match="layout file not found"):
        k3opt.load_layout(tmp_path / "nope.toml")
    result = CliRunner().invoke(main, ["explain", str(tmp_path / "nope.toml")])
    assert result.exit_code == 2 and "file not found" in result.output


def test_malformed_cluster_file_names_field(tmp_path):
    path = _write(tmp_path, 'name = "x"\nhbm_mib = -1\n', "cluster.toml")
    with pytest.raises(k3opt.SpecError, match="hbm_mib"):
        k3opt.load_cluster(path)


def test_make_layout_raises_layout_error():
    with pytest.raises(k3opt.LayoutError, match="split has 1 entries"):
        k3opt.make_layout(gpus=8, pp=2, split=[93])


def test_every_error_is_a_k3opt_error():
    for exc in (k3opt.SpecError, k3opt.LayoutError, k3opt.PresetNotFoundError, k3opt.InfeasibleJobError):
        assert issubclass(exc, k3opt.K3optError)
    # a search cut before its first layout is an infeasible job to a caller that catches that, told apart by type
    assert issubclass(k3opt.SearchTimeoutError, k3opt.InfeasibleJobError)


JOB_CASES = {
    # The job's placement fields: racks must be a positive integer, the GPUs must fit in the racks, and a pinned
    # GPUs-per-domain no larger than the cluster's NVLink domain (72 on GB200 NVL72).
    "racks_zero": ("racks = 0\ngpus = 512\n", "racks"),
    "racks_negative": ("racks = -3\n", "racks"),
    "racks_string": ('racks = "eight"\n', "racks"),
    "more_gpus_than_racks_hold": ("racks = 7\ngpus = 512\n", "512 GPUs do not fit in 7 racks of 72 GPUs (504)"),
    "domain_above_its_size": ("gpus = 512\ndomain_gpus_used = 96\n",
                              "domain_gpus_used (96) exceeds the 72-GPU NVLink domain"),
    "neither_gpus_nor_racks": ("context = 4096\n", "give gpus"),
    # The peak cap of [search] is a positive number of GiB.
    "max_peak_zero": ("gpus = 512\n[search]\nmax_peak_gib = 0\n", "max_peak_gib"),
    "max_peak_negative": ("gpus = 512\n[search]\nmax_peak_gib = -90.5\n", "max_peak_gib"),
    "max_peak_string": ('gpus = 512\n[search]\nmax_peak_gib = "ninety"\n', "max_peak_gib"),
    # 512 GPUs at 32 per rack take 16 racks.
    "pinned_size_needs_more_racks": ("racks = 8\ngpus = 512\ndomain_gpus_used = 32\n",
                                     "512 GPUs at domain_gpus_used = 32 take 16 racks, more than racks = 8"),
    # Hopper has no block-scaled tensor cores (constraints/clusters/h100-sxm.toml: microscaling = false): an
    # accepted precision it cannot run names the field and what the cluster runs.
    "precision_the_cluster_cannot_run": (
        'model = "llama3-70b"\ncluster = "h100-sxm"\ngpus = 64\ncontext = 8192\nprecisions = ["mxfp8", "fp8"]\n',
        "the job's precisions list mxfp8, which h100-sxm cannot run; list only bf16, fp8 in `precisions`"),
    # GB200's 189,471 MiB is 185.03 GiB: a reserve of 200 GiB leaves no HBM to plan in.
    "reserve_above_the_hbm": ("gpus = 512\nreserve_gib = 200\n",
                              "reserve_gib = 200 leaves nothing of gb200-nvl72's 185.03 GiB of HBM per GPU"),
    "no_precision_accepted": ("gpus = 512\nprecisions = []\n", "precisions: List should have at least 1 item"),
    # Qwen3-30B-A3B trains every tensor with AdamW (constraints/models/qwen3-30b-a3b.toml [optimizer]).
    "p2p_muon_required_without_muon": (
        'model = "qwen3-30b-a3b"\ncluster = "b200"\ngpus = 64\n[search]\nrequire_toggles = ["p2p_muon"]\n',
        "require_toggles lists p2p_muon, but qwen3-30b-a3b trains every tensor with AdamW"),
    # Llama 3 70B has no MoE layers (constraints/models/llama3-70b.toml has no [moe]).
    "moe_toggle_required_on_a_dense_model": (
        'model = "llama3-70b"\ncluster = "b200"\ngpus = 64\n[search]\nrequire_toggles = ["dispatch_recompute"]\n',
        "require_toggles lists dispatch_recompute, but llama3-70b has no MoE layers: remove it"),
    # [search] offload_modules: sets of Megatron's offload modules, each non-empty, each offloading something.
    "offload_set_empty": ("gpus = 512\n[search]\noffload_modules = [[]]\n", "an offload_modules set is empty"),
    "offload_set_unknown_module": ('gpus = 512\n[search]\noffload_modules = [["router"]]\n', "offload_modules"),
    "offload_set_attn_proj_alone": ('gpus = 512\n[search]\noffload_modules = [["attn_proj"]]\n',
                                    "'attn_proj' needs 'core_attn'"),
    "offload_set_a_dense_model_lacks": (
        'model = "llama3-70b"\ncluster = "b200"\ngpus = 64\n[search]\noffload_modules = [["moe_act"]]\n',
        "offload_modules 'moe_act' offloads nothing in llama3-70b: it has no routed experts"),
    "offload_set_fc1_with_fp8": (
        'gpus = 512\nprecisions = ["bf16", "fp8"]\n[search]\noffload_modules = [["expert_fc1"]]\n',
        "with precision fp8 in precisions"),
    # 3 divides no count of 512 GPUs: the one [search] list that leaves no shape is named with its rule.
    "search_pp_divides_no_gpu_count": ('gpus = 512\n[search]\npp = [3]\n',
                                       "[search] pp = [3] (PP divides the GPUs and is at most the layers) alone"),
    # 16,777,216 tokens / (DP x 4,096) is a power of two for every shape: 7 microbatches is none of them.
    "search_microbatches_off_the_batch": ('gpus = 512\n[search]\nmicrobatches = [7]\n',
                                          "[search] microbatches = [7] (microbatches = tokens_per_update"),
    # A job lists the precisions it may choose among: the layout's field name, singular, is pointed to the list.
    "job_precision_singular": ('gpus = 512\nprecision = "fp8"\n',
                               "precision: unknown key (did you mean 'precisions'?)"),
    # A job key written under [search], and a [search] key written at the top: the line says where it belongs.
    "job_key_under_search": ('gpus = 512\n[search]\nprecisions = ["mxfp8"]\n',
                             "search.precisions: unknown key here; 'precisions' is a top-level key: move it above "
                             "the [search] table"),
    "search_key_at_the_top": ('gpus = 512\nrecompute = ["full"]\n',
                              "recompute: unknown key here; 'recompute' belongs in the [search] table"),
    # Two lists each exclude every shape: neither alone is to blame, so the line names the job's sizes.
    "search_two_lists_leave_no_shape": ('gpus = 512\n[search]\npp = [3]\nep = [3]\n',
                                        "no parallel shape satisfies the job's rules (gpus 512"),
}


def test_a_job_without_tokens_per_update_names_what_to_give(tmp_path):
    """A rule over the whole job file (no field to blame) reads as the file's own line, with no location."""
    path = _write(tmp_path, "gpus = 512\n", "job.toml")
    result = CliRunner().invoke(main, ["plan", str(path), "--time-limit", "5"])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert lines == ["k3opt: error: job job.toml: give tokens_per_update or a [search] microbatches list"], lines


@pytest.mark.parametrize("case", sorted(JOB_CASES))
def test_job_placement_errors_exit_2_with_one_line(tmp_path, case):
    text, fragment = JOB_CASES[case]
    path = _write(tmp_path, "tokens_per_update = 16777216\n" + text, "job.toml")
    result = CliRunner().invoke(main, ["plan", str(path), "--time-limit", "5"])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("k3opt: error:"), lines
    assert fragment in lines[0]
    with pytest.raises(k3opt.K3optError, match=re.escape(fragment)):
        k3opt.plan(k3opt.load_job(path), time_limit=5)
