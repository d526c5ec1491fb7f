"""CUDA graph settings of a layout: read from the measured recipes, checked against the model, written by the
exports under Megatron's own names, and listed as unpriced."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.inputs.presets import load_layout
from k3opt.inputs.specs import Layout
from k3opt.launch import to_launch
from k3opt.report.throughput import validate_throughput

MEASURED = "layouts/measured/"


def _measured(name: str) -> Layout:
    return load_layout(MEASURED + name)


def _with(lay: Layout, **fields: object) -> Layout:
    return Layout.model_validate({**lay.model_dump(), **fields})


def test_measured_runs_state_their_recipes_graphs():
    # Megatron-Bridge v0.4.2 qwen3_workload_base_configs.py: the Qwen3-30B-A3B GB200 MXFP8 config graphs only the
    # router and the EP preprocess; the Llama 3 70B GB200 recipe sets no cuda_graph_impl (eager).
    rows = {r.id: r.cuda_graphs for r in validate_throughput().rows}
    assert rows["MB-20"] == "transformer_engine[moe_router,moe_preprocess]"
    assert rows["MB-22"] == "transformer_engine[attn,moe_router,moe_preprocess]"
    assert rows["MB-2"] == "none"


def test_exports_write_megatrons_names():
    lay = _measured("mb-22-deepseek-v3-gb200.toml")
    lm = dict(to_launch(lay, "megatron-lm", "deepseek-v3").settings)
    assert lm["--cuda-graph-impl"] == "transformer_engine"
    assert lm["--cuda-graph-modules"] == "attn moe_router moe_preprocess"
    bridge = dict(to_launch(lay, "megatron-bridge", "deepseek-v3").settings)
    assert bridge["model.cuda_graph_impl"] == "transformer_engine"
    assert bridge["model.cuda_graph_scope"] == "[attn,moe_router,moe_preprocess]"
    tt = to_launch(lay, "torchtitan", "deepseek-v3")
    assert any("cuda_graph_impl = transformer_engine" in m.decision for m in tt.missing)


def test_full_iteration_exports_no_modules_and_unstated_exports_nothing():
    lay = _with(_measured("mb-13-deepseek-v3-gb200.toml"), cuda_graph_impl="full_iteration", cuda_graph_modules=[])
    lm = dict(to_launch(lay, "megatron-lm", "deepseek-v3").settings)
    assert lm["--cuda-graph-impl"] == "full_iteration" and "--cuda-graph-modules" not in lm
    plain = _with(lay, cuda_graph_impl=None)
    assert not any("cuda-graph" in k for k in dict(to_launch(plain, "megatron-lm", "deepseek-v3").settings))


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
