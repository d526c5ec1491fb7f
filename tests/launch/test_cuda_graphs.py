"""CUDA graph settings of a layout: read from the measured recipes, checked against the model, written by the
exports under Megatron's own names, and listed as unpriced."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.inputs.presets import load_layout
from k3opt.inputs.specs import Layout
from k3opt.launch import to_launch
from k3opt.report.text import explain_text
from k3opt.report.throughput import validate_throughput

MEASURED = "layouts/measured/"


def _measured(name: str) -> Layout:
    return load_layout(MEASURED + name)


def _with(lay: Layout, **fields: object) -> Layout:
    return Layout.model_validate({**lay.model_dump(), **fields})


def test_measured_runs_state_their_recipes_graphs():
    # Megatron-Bridge v0.4.2 qwen3_workload_base_configs.py: the Qwen3-30B-A3B GB200 MXFP8 config graphs only the
    # router and the EP preprocess; the Llama 3 70B GB200 recipe sets no cuda_graph_impl (eager). v0.4.2
    # deepseek_workload_base_configs.py: the DeepSeek-V3 GB200 MXFP8 config adds attention; the 25.11 release's
    # (v0.2.1 workload_base_configs.py L56) DeepSeek-V3 GB200 config graphs the router and preprocess only.
    rows = {r.id: r.cuda_graphs for r in validate_throughput().rows}
    assert rows["MB-20"] == "transformer_engine[moe_router,moe_preprocess]"
    assert rows["MB-13"] == "transformer_engine[attn,moe_router,moe_preprocess]"
    assert rows["MB-22"] == "transformer_engine[moe_router,moe_preprocess]"
    assert rows["MB-2"] == "none"


def test_exports_write_megatrons_names():
    lay = _measured("mb-13-deepseek-v3-gb200.toml")
    lm = dict(to_launch(lay, "megatron-lm", "deepseek-v3").settings)
    assert lm["--cuda-graph-impl"] == "transformer_engine"
    assert lm["--cuda-graph-modules"] == "attn moe_router moe_preprocess"
    bridge = dict(to_launch(lay, "megatron-bridge", "deepseek-v3").settings)
    assert bridge["model.cuda_graph_impl"] == "transformer_engine"
    assert bridge["model.cuda_graph_scope"] == "[attn,moe_router,moe_preprocess]"
    tt = to_launch(lay, "torchtitan", "deepseek-v3")
    assert any("cuda_graph_impl = transformer_engine" in m.decision for m in tt.missing)


def test_full_iteration_exports_its_companion_switches_and_unstated_exports_nothing():
    # Llama 3 70B is dense, so a full-iteration graph can capture it. Megatron-LM asserts the NaN check off under it
    # (training/arguments.py L1235-1237), Bridge the same (training/config.py L1508-1512) and TE's RNG tracker on
    # under any graph (models/gpt_provider.py L233-238).
    lay = _with(_measured("mb-1-llama3-70b-gb300.toml"), cuda_graph_impl="full_iteration")
    lm = dict(to_launch(lay, "megatron-lm", "llama3-70b").settings)
    assert lm["--cuda-graph-impl"] == "full_iteration" and "--cuda-graph-modules" not in lm
    assert lm["--no-check-for-nan-in-loss-and-grad"] == ""
    bridge = dict(to_launch(lay, "megatron-bridge", "llama3-70b").settings)
    assert bridge["rerun_state_machine.check_for_nan_in_loss"] == "false"
    assert bridge["model.use_te_rng_tracker"] == "true"
    plain = _with(lay, cuda_graph_impl=None)
    assert not any("cuda-graph" in k for k in dict(to_launch(plain, "megatron-lm", "llama3-70b").settings))
    assert "model.use_te_rng_tracker" not in dict(to_launch(plain, "megatron-bridge", "llama3-70b").settings)


def test_a_whole_layer_graph_clears_a_recipe_s_scope_on_bridge():
    # Per-layer graphs with no module named capture the whole layer: Megatron-LM's default needs no flag, but a
    # Bridge recipe may carry its own scope list, so the export writes an empty one.
    lay = _with(_measured("mb-1-llama3-70b-gb300.toml"), activation_offload_layers=0,
                cuda_graph_impl="transformer_engine")
    bridge = dict(to_launch(lay, "megatron-bridge", "llama3-70b").settings)
    assert bridge["model.cuda_graph_scope"] == "[]"
    assert "--cuda-graph-modules" not in dict(to_launch(lay, "megatron-lm", "llama3-70b").settings)


def test_unpriced_names_the_host_launch_cost():
    ev = k3opt.evaluate(_measured("mb-20-qwen3-30b-a3b-gb200.toml"))
    assert any("host-side kernel launch" in u for u in ev.step.unpriced)


def test_moe_modules_on_a_dense_model_are_refused():
    # Llama 3 70B has no MoE layer: Megatron asserts 'moe cuda graph is only supported for MoE'.
    lay = _with(_measured("mb-1-llama3-70b-gb300.toml"), activation_offload_layers=0,
                cuda_graph_impl="transformer_engine", cuda_graph_modules=["attn", "moe_router"])
    with pytest.raises(k3opt.LayoutError, match="has no MoE layers"):
        k3opt.evaluate(lay)


def test_mlp_module_on_an_all_moe_model_is_refused():
    # Qwen3-30B-A3B: every one of its 48 layers is MoE, so there is no dense MLP to capture.
    lay = _with(_measured("mb-20-qwen3-30b-a3b-gb200.toml"), cuda_graph_modules=["mlp", "moe_router"])
    with pytest.raises(k3opt.LayoutError, match="every layer of qwen3-30b-a3b is MoE"):
        k3opt.evaluate(lay)


def test_per_layer_graphs_with_cpu_offloading_are_refused():
    # MB-2 offloads the first layers' activations with TransformerEngine's CPU offloading (cpu_offloading_num_layers):
    # Megatron raises 'CUDA graphs not supported with CPU offloading' unless the graph is full_iteration.
    lay = _measured("mb-2-llama3-70b-gb200.toml")
    assert lay.activation_offload_layers > 0
    with pytest.raises(ValueError, match="refuses per-layer CUDA graphs with CPU offloading"):
        _with(lay, cuda_graph_impl="transformer_engine", cuda_graph_modules=["attn"])
    assert _with(lay, cuda_graph_impl="full_iteration").cuda_graph_impl == "full_iteration"


@pytest.mark.parametrize("impl, modules", [("full_iteration", []), ("transformer_engine", []), ("local", [])])
def test_graphs_that_capture_a_dropless_moe_layer_whole_are_refused(impl, modules):
    # Megatron-LM docs/user-guide/features/cuda_graph.md L161: MoE expert dispatch has dynamic shapes and cannot be
    # captured, so a DeepSeek-V3 layout may graph its layers only by module.
    lay = _with(_measured("mb-13-deepseek-v3-gb200.toml"), cuda_graph_impl=impl, cuda_graph_modules=modules)
    with pytest.raises(k3opt.LayoutError, match="cannot be captured"):
        k3opt.evaluate(lay)


def test_local_graphs_take_moe_preprocess_alone():
    # Under "local" Megatron adds moe_router beside moe_preprocess itself (transformer_config.py L2805-2815); only
    # TE's graphs need both named.
    lay = _with(_measured("mb-20-qwen3-30b-a3b-gb200.toml"), cuda_graph_impl="local",
                cuda_graph_modules=["moe_preprocess"])
    assert k3opt.evaluate(lay).step.achievable_step_time_s > 0
    with pytest.raises(ValueError, match="needs 'moe_router' beside it"):
        _with(lay, cuda_graph_impl="transformer_engine")


def test_activation_offload_beside_local_or_full_iteration_graphs_is_refused():
    # k3opt's activation offload exports attention modules to --offload-modules: Megatron takes them beside
    # transformer_engine graphs only (transformer_config.py L2929-2975).
    lay = _with(_measured("mb-20-qwen3-30b-a3b-gb200.toml"), recompute="selective")
    on = {**lay.toggles.model_dump(), "activation_offload": True}
    ok = _with(lay, toggles=on)
    assert ok.cuda_graph_impl == "transformer_engine"
    for impl, mods in (("local", ["attn"]), ("full_iteration", [])):
        with pytest.raises(ValueError, match="fine-grained activation offloading of attention modules"):
            _with(ok, cuda_graph_impl=impl, cuda_graph_modules=mods)


def test_exports_train_without_dropout_as_the_ledger_prices():
    """The ledger holds no dropout masks, and Megatron's TransformerConfig defaults both dropouts to 0.1
    (transformer_config.py L188-192 @ d98e8a64): every Megatron export sets them to 0, as Megatron-Bridge's model
    bridges do (deepseek_v3_bridge.py L87). A whole-layer graph with the MLP recomputed needs it: Megatron asserts
    hidden_dropout == 0 there (transformer_config.py L2886-2899)."""
    lay = _with(_measured("mb-1-llama3-70b-gb300.toml"), cuda_graph_impl="transformer_engine", cuda_graph_modules=[],
                recompute="selective", recompute_modules=["mlp"], activation_offload_layers=0)
    lm = dict(to_launch(lay, "megatron-lm", "llama3-70b").settings)
    assert lm["--hidden-dropout"] == "0.0" and lm["--attention-dropout"] == "0.0"
    assert lm["--cuda-graph-impl"] == "transformer_engine" and "--cuda-graph-modules" not in lm
    bridge = dict(to_launch(_measured("mb-13-deepseek-v3-gb200.toml"), "megatron-bridge", "deepseek-v3").settings)
    assert bridge["model.hidden_dropout"] == "0.0" and bridge["model.attention_dropout"] == "0.0"


def test_a_full_iteration_graph_holds_the_activation_phase_through_the_optimizer_step():
    """Megatron captures forward-backward into one graph whose private pool keeps its bytes reserved for replay, and
    runs the optimizer step eagerly from the ordinary pool (full_cuda_graph.py L206-243, training.py L4433-4453 @
    d98e8a64): the peak is persistent + activation phase + optimizer phase, where eager or per-layer graphs give
    persistent + the larger phase (seed 001's ledger). Qwen3-30B-A3B on 8 GB300, one rank: the two differ by the
    smaller phase, here the optimizer step's transient."""
    graphed = k3opt.evaluate(_measured("qwen3-30b-a3b-gb300-mxfp8-paged-stash.toml"))
    eager = k3opt.evaluate(_with(graphed.layout, cuda_graph_impl="none"))
    (g,), (e,) = graphed.ranks, eager.ranks
    assert g.ledger == e.ledger  # the graph changes when bytes are live, not the bytes
    assert g.activation_phase_bytes > g.optimizer_phase_bytes > 0
    assert e.peak_bytes == e.persistent_bytes + e.activation_phase_bytes
    assert g.peak_bytes == g.persistent_bytes + g.activation_phase_bytes + g.ledger["optimizer_transient"]
    assert g.peak_bytes - e.peak_bytes == g.optimizer_phase_bytes
    assert "activation phase + optimizer phase" in explain_text(graphed)
