"""Sharding policies, whole-tensor ownership and the validation rows, pinned where a figure or a printed formula
could change unnoticed: the term formulas per policy / dtype / granularity (they name which degree divides each
term), the state of the rank owning the most whole tensors against the parameter inventory of seed 003's 4-layer
proxy, and the like-with-like memory comparisons (which rank, which kind, which unit)."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.cost.evaluate import _policy_formulas, memory_comparisons
from k3opt.cost.structure import structure_of
from k3opt.inputs.errors import LayoutError
from k3opt.inputs.specs import Measured

GIB = 2**30
PROXY = "k3-4layer-dist-muon-8gpu"
TRANSIENT = ("without P2P Muon, BF16 all-gathered at the step: optim_grads_params groups 2 x params (plus "
             "Newton-Schulz), optim / optim_grads in place (element) or into receive buffers after Newton-Schulz "
             "(tensor): max(2 x sharded params, NS)")


def _variant(base: k3opt.Layout, **fields) -> k3opt.Layout:
    return k3opt.Layout.model_validate({**base.model_dump(), **fields})


@pytest.fixture(scope="module")
def proxy() -> k3opt.Layout:
    return k3opt.load_layout(PROXY)


@pytest.fixture(scope="module")
def inventory():
    """Seed 003 proxy at EP8 on 8 GPUs (expert FSDP 1): (dense Muon, dense AdamW, routed Muon per rank, routed
    AdamW per rank, largest dense tensor), from the tensor inventory (pinned by name and shape in test_golden)."""
    st = structure_of(k3opt.load_model("kimi-k3-4layer-proxy"))
    blocks = [b for layer in [*st.layers, st.first, st.last] for b in layer]
    dm = sum(b.params("muon", routed=False) for b in blocks)
    da = sum(b.params("adamw", routed=False) for b in blocks)
    rm = sum(b.params("muon", routed=True) for b in blocks) // 8
    ra = sum(b.params("adamw", routed=True) for b in blocks) // 8
    largest = max(t.numel for b in blocks for t in b.tensors if not t.routed)
    return dm, da, rm, ra, largest


def test_formulas_name_the_degree_that_divides_each_term(proxy):
    """Masters and state are divided by the group when the policy shards them (optim and up); the gradient
    buffer only under optim_grads / optim_grads_params; 'of the rank owning the most whole tensors' with tensor
    granularity; the byte widths follow grad_dtype and optimizer_state_dtype."""
    seed003 = _policy_formulas(proxy)  # optim / optim, tensor granularity, FP32 / FP32
    assert seed003 == {
        "master": "FP32 masters of the rank owning the most whole tensors: 4 x (D/f_d + E/e/f_e) "
                  "(dense optim, expert optim)",
        "grads": "FP32 gradients: 4 x (D + E/e) (dense optim, expert optim; unsharded = the whole buffer)",
        "optimizer": "Muon momentum 4 B + AdamW moments 8 B per owned parameter of the rank owning the most "
                     "whole tensors",
        "optimizer_transient": TRANSIENT}
    mixed = _variant(proxy, dense_sharding="optim_grads", expert_sharding="no_shard",
                     optimizer_shard_granularity="element", grad_dtype="bf16", optimizer_state_dtype="bf16")
    assert _policy_formulas(mixed) == {
        "master": "FP32 masters: 4 x (D/f_d + E/e) (dense optim_grads, expert no_shard)",
        "grads": "BF16 gradients: 2 x (D/f_d + E/e) (dense optim_grads, expert no_shard; unsharded = the whole "
                 "buffer)",
        "optimizer": "Muon momentum 2 B + AdamW moments 4 B per owned parameter",
        "optimizer_transient": TRANSIENT}
    swapped = _variant(proxy, dense_sharding="no_shard", expert_sharding="optim_grads_params",
                       optimizer_shard_granularity="element")
    f = _policy_formulas(swapped)
    assert f["master"] == "FP32 masters: 4 x (D + E/e/f_e) (dense no_shard, expert optim_grads_params)"
    assert f["grads"] == ("FP32 gradients: 4 x (D + E/e/f_e) (dense no_shard, expert optim_grads_params; "
                          "unsharded = the whole buffer)")


@pytest.mark.parametrize("fields", [
    {"optimizer_shard_granularity": "tensor"}, {"grad_dtype": "bf16"}, {"optimizer_state_dtype": "bf16"},
    {"expert_sharding": "optim"}, {"dense_sharding": "optim_grads"}])
def test_any_one_non_default_choice_replaces_the_default_formulas(proxy, fields):
    """The default (optim_grads_params both, element, FP32 / FP32) keeps TERM_INFO's formulas; changing any one
    of the five choices prints the policy formulas."""
    default = dict(dense_sharding="optim_grads_params", expert_sharding="optim_grads_params",
                   optimizer_shard_granularity="element", grad_dtype="fp32", optimizer_state_dtype="fp32")
    assert _policy_formulas(_variant(proxy, **default)) == {}
    assert set(_policy_formulas(_variant(proxy, **{**default, **fields}))) == {"master", "grads", "optimizer",
                                                                             "optimizer_transient"}


def test_evaluate_prints_the_policy_formulas(proxy):
    ev = k3opt.evaluate(proxy)
    terms = {t.key: t.formula for t in ev.ranks[0].terms}
    assert {k: terms[k] for k in ("master", "grads", "optimizer")} == {
        k: v for k, v in _policy_formulas(proxy).items() if k != "optimizer_transient"}


def test_unsharded_tensor_ownership_holds_the_whole_rank(proxy, inventory):
    """no_shard on both groups with tensor granularity: the owner holds every tensor of the rank, as the framework
    builds them: Megatron-Bridge's Kimi K3 layer builds both AttnRes norm + proj pairs in every layer
    (kimi_k3_layers.py L460-463 at 067f987d), so the proxy's one layer whose checkpoint has no attention pair holds
    norm [d] + proj [1, d] = 2 x 7,168 more AdamW parameters. master = 4 B x (D + E/8 + 2d); optimizer = s x Muon
    + 2 s x AdamW with s = 2 (BF16 state); gradients unsharded = g x (D + E/8) with g = 2 (BF16), the checkpoint's
    count as the gradient buffer holds it."""
    dm, da, rm, ra, _ = inventory
    da = da + 2 * 7168
    lay = _variant(proxy, dense_sharding="no_shard", expert_sharding="no_shard", grad_dtype="bf16",
                   optimizer_state_dtype="bf16")
    led = k3opt.evaluate(lay).ranks[0].ledger
    assert led["master"] == 4 * (dm + da + rm + ra)
    assert led["optimizer"] == 2 * (dm + rm) + 2 * 2 * (da + ra)
    assert led["grads"] == 2 * (dm + da - 2 * 7168 + rm + ra)


def test_sharded_tensor_ownership_is_one_owner_of_eight(proxy, inventory):
    """optim_grads on the dense group of 8 with whole tensors: the most-loaded owner holds at least 1/8 of the
    dense parameters and at most 1/8 plus the largest tensor (largest-first assignment); the experts (EP8 on 8
    GPUs: a group of 1) stay whole. The sharded FP32 gradients cover the same owned tensors as the masters,
    so grads / 4 B = master / 4 B = the owned parameters."""
    dm, da, rm, ra, largest = inventory
    lay = _variant(proxy, dense_sharding="optim_grads", expert_sharding="optim_grads")
    led = k3opt.evaluate(lay).ranks[0].ledger
    owned_dense = led["master"] / 4 - (rm + ra)
    assert (dm + da) / 8 <= owned_dense <= (dm + da) / 8 + largest
    assert led["grads"] == led["master"]
    # Under optim (gradient buffer whole) the masters are the same owned set, the gradients the whole rank.
    whole = k3opt.evaluate(_variant(proxy, dense_sharding="optim", expert_sharding="optim")).ranks[0].ledger
    assert whole["master"] == led["master"]
    assert whole["grads"] == 4 * (dm + da + rm + ra)


def test_host_resident_gradients_leave_the_owned_gradients_out(proxy):
    """pipeline_zero2_host_grads keeps the gradients on the host: the tensor-owned state then sets only master
    and optimizer, and the device gradient term is the ZeRO-2 chunk buffers, not the owned share."""
    lay = _variant(proxy, dense_sharding="optim_grads", expert_sharding="optim_grads")
    on = _variant(lay, toggles={**lay.toggles.model_dump(), "pipeline_zero2_host_grads": True})
    a, b = k3opt.evaluate(lay).ranks[0].ledger, k3opt.evaluate(on).ranks[0].ledger
    assert b["master"] == a["master"] and b["optimizer"] == a["optimizer"]
    assert b["grads"] != a["grads"]


def test_validation_rows_of_seed_003_name_rank_owner_unit_and_kind(proxy):
    ev = k3opt.evaluate(proxy)
    r0 = ev.ranks[0]
    rows = [(c.figure, c.measured, c.unit, c.kind) for c in ev.validation if c.kind]
    assert rows == [
        ("resident state, PP rank 0, DP rank 0", 181.18, "GiB", "allocated"),
        ("resident before the first step, PP rank 0, DP rank 0", 135.93, "GiB", "allocated"),
        ("grads, PP rank 0, DP rank 0", 60.75, "GiB", "allocated"),
        ("master, PP rank 0, DP rank 0", 44.80, "GiB", "allocated"),
        ("optimizer, PP rank 0, DP rank 0", 44.79, "GiB", "allocated"),
        ("bf16_view, PP rank 0, DP rank 0", 30.38, "GiB", "allocated"),
        ("optimizer-step transient, PP rank 0, DP rank 0", 9.71, "GiB", "allocated")]
    modeled = {c.figure.split(",")[0]: c.modeled for c in ev.validation}
    # Compared on DP rank 0 (the seed's rank), whose owned share the ledger's worst owner may exceed.
    assert modeled["master"] == r0.counts["owned_per_dp_rank"][0]["master"] / GIB
    assert r0.ledger["master"] >= r0.counts["owned_per_dp_rank"][0]["master"]
    # Element granularity: no owner suffix.
    element = k3opt.evaluate(_variant(proxy, optimizer_shard_granularity="element"))
    assert [c.figure for c in element.validation if c.kind][0] == "resident state, PP rank 0"


def test_memory_comparisons_pick_the_stated_rank_or_the_worst(reference_eval):
    """The seed reference: PP rank 0 has the largest peak (embedding, vision and 10 layers), rank 7 the
    smallest. A stated rank is compared as stated; an unstated rank is the worst; an unstated kind is compared
    against both the reserved and the device peak."""
    ranks = reference_eval.ranks
    assert max(ranks, key=lambda r: r.peak_bytes).rank == 0 and ranks[7].peak_bytes < ranks[0].peak_bytes
    stated = Measured(kind="allocated", rank=7, peak_gib=80.0, resident_gib=40.0, pre_step_resident_gib=30.0,
                      optimizer_transient_gib=5.0, terms_gib={"grads": 3.0})
    rows = memory_comparisons(stated, ranks, ", owner X")
    assert [(c.figure, c.unit, c.kind) for c in rows] == [
        ("peak HBM, rank 7", "GiB", "allocated"),
        ("resident state, PP rank 7, owner X", "GiB", "allocated"),
        ("resident before the first step, PP rank 7, owner X", "GiB", "allocated"),
        ("grads, PP rank 7, owner X", "GiB", "allocated"),
        ("optimizer-step transient, PP rank 7, owner X", "GiB", "allocated")]
    assert rows[0].modeled == ranks[7].allocated_bytes / GIB
    assert rows[1].modeled == ranks[7].persistent_bytes / GIB
    assert rows[4].modeled == ranks[7].optimizer_phase_bytes / GIB
    unstated = memory_comparisons(Measured(peak_gib=150.0, resident_gib=40.0), ranks)
    assert [(c.figure, c.kind) for c in unstated] == [
        ("peak HBM, worst rank (0)", "reserved"), ("peak HBM, worst rank (0)", "device"),
        ("resident state, PP rank 0", "allocated")]
    assert unstated[0].modeled == ranks[0].reserved_bytes / GIB
    assert unstated[1].modeled == ranks[0].device_bytes / GIB
    with pytest.raises(LayoutError) as err:
        memory_comparisons(Measured(terms_gib={"nope": 1.0}), ranks)
    assert str(err.value) == "measured.terms_gib.nope: not a ledger key; known: " + ", ".join(ranks[0].ledger)
