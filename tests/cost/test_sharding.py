"""Sharding policies as layout fields (Megatron's vocabulary), whole-tensor optimizer ownership, lazy optimizer
state, and seed 003's reconciliations (the K3 activation-model review, dist_muon on a 4-layer proxy); the term
formulas each policy prints, the rank owning the most bytes of whole tensors (the byte widths of its state decide),
and the like-with-like memory comparisons of the validation rows (which rank, which kind, which unit)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import k3opt
from k3opt.cli import main
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.cost.evaluate import _policy_formulas, _tensor_owned_state, memory_comparisons
from k3opt.cost.sharding import count_owned_per_rank, framework_tensors, ping_pong, worst_owned
from k3opt.cost.structure import structure_of
from k3opt.inputs.errors import LayoutError
from k3opt.inputs.specs import Measured
from k3opt.report.validate import validation_rows

GIB = 2**30
PROXY = "k3-4layer-dist-muon-8gpu"


@pytest.fixture(scope="module")
def proxy_eval():
    return k3opt.evaluate(k3opt.load_layout(PROXY))


@pytest.fixture(scope="module")
def proxy_params():
    """Dense (non-routed) and per-rank routed parameters of the 4-layer proxy at EP8."""
    st = structure_of(k3opt.load_model("kimi-k3-4layer-proxy"))
    blocks = [b for layer in [*st.layers, st.first, st.last] for b in layer]
    dense = sum(b.params(routed=False) for b in blocks)
    routed = sum(b.params(routed=True) for b in blocks)
    return dense, routed // 8


def _rows():
    return {r.figure.split(",")[0]: r for r in validation_rows() if r.layout == PROXY}


def test_default_policy_is_todays_ledger(reference, model, cluster, reference_eval):
    explicit = k3opt.Layout.model_validate({**reference.model_dump(), "dense_sharding": "optim_grads_params",
                                            "expert_sharding": "optim_grads_params",
                                            "optimizer_shard_granularity": "element"})
    ev = k3opt.evaluate(explicit, model=model, cluster=cluster)
    assert [r.ledger for r in ev.ranks] == [r.ledger for r in reference_eval.ranks]


def test_seed_003_param_grad_buf_60_75_and_bf16_cast_30_38(proxy_eval, proxy_params):
    """Whole FP32 gradient buffer 4 B and whole BF16 weights 2 B per parameter of the rank (D + E/8)."""
    dense, routed = proxy_params
    r0 = proxy_eval.ranks[0]
    assert r0.ledger["grads"] == pytest.approx(4 * (dense + routed), abs=1)
    assert r0.ledger["bf16_view"] == pytest.approx(2 * (dense + routed), abs=1)
    assert round(r0.ledger["grads"] / GIB, 2) == 60.75
    assert abs(r0.ledger["bf16_view"] / GIB - 30.38) < 0.01


def test_seed_003_optimizer_step_transient_9_7_gib(proxy_eval, proxy_params):
    """The layer-wise all-gather receives every sharded group's BF16 params: at EP8 on 8 GPUs the expert group
    has one rank (nothing to gather), so 2 B x the dense parameters = 9.70 GiB (seed: 9.70 at seq 4096; 9.71 =
    7.98 receive + 1.73 local flatten). Newton-Schulz runs before it, so the larger of the two counts."""
    dense, _ = proxy_params
    r0 = proxy_eval.ranks[0]
    assert r0.ledger["optimizer_transient"] == pytest.approx(2 * dense, abs=1)
    assert round(r0.ledger["optimizer_transient"] / GIB, 2) == 9.70


def test_seed_003_lazy_state_and_resident(proxy_eval):
    """Seed 003 states resident 181.18 GiB = 60.75 + 44.80 + 44.79 + 30.38, but the four terms sum to 180.72;
    the pre-step reading 135.93 + the lazy 44.79 is also 180.72. The ledger's resident set is the same four
    terms, and its pre-step resident leaves out the lazily allocated state; both are compared in validate."""
    assert round(60.75 + 44.80 + 44.79 + 30.38, 2) == round(135.93 + 44.79, 2) == 180.72
    r0 = proxy_eval.ranks[0]
    four = sum(r0.ledger[k] for k in ("grads", "master", "optimizer", "bf16_view"))
    assert r0.persistent_bytes == four
    assert r0.counts["resident_before_first_step_bytes"] == r0.persistent_bytes - r0.ledger["optimizer"]
    # The measured rank is DP rank 0: its own masters and gradients, the whole BF16 weights, no state yet.
    dp0 = r0.counts["owned_per_dp_rank"][0]
    pre = _rows()["resident before the first step"]
    assert pre.measured == 135.93
    assert pre.modeled == pytest.approx((dp0["grads"] + dp0["master"] + r0.ledger["bf16_view"]) / GIB)


def test_seed_003_validation_rows_show_the_gap(proxy_eval):
    rows = _rows()
    assert {r.kind for r in rows.values()} == {"allocated"}
    assert rows["resident state"].measured == 181.18
    for key in ("grads", "bf16_view", "optimizer-step transient"):
        assert abs(rows[key].gap) < 0.01, rows[key]
    # Whole-tensor ownership by Megatron's assignment: the measured DP rank 0 owns 3.45 GiB of dense masters
    # (0.93 G parameters, all Muon) besides its 112 local experts per projection of 3 MoE layers,
    # 3 x 3 x 112 x 3072 x 3584 x 4 B = 41.34 GiB; Muon momentum is 4 B per parameter, so state = master.
    experts = 3 * 3 * 112 * 3072 * 3584 * 4 / GIB
    assert round(experts, 2) == 41.34
    assert abs(rows["master"].gap) < 0.01 and abs(rows["optimizer"].gap) < 0.02
    assert round(rows["master"].modeled - experts, 2) == 3.45
    # The ledger (the HBM constraint) keeps the rank owning the most: it owns the embedding or the LM head.
    r0 = proxy_eval.ranks[0]
    assert r0.ledger["master"] >= max(d["master"] for d in r0.counts["owned_per_dp_rank"])
    assert r0.ledger["master"] / GIB - experts >= 4 * 163840 * 7168 / GIB
    dp0 = r0.counts["owned_per_dp_rank"][0]
    resident0 = r0.persistent_bytes + sum(dp0.values()) - sum(r0.ledger[k] for k in dp0)
    assert rows["resident state"].gap == pytest.approx(181.18 - resident0 / GIB)


def test_seed_003_state_bytes_per_param_2_4_8_over_dp():
    """Seed 003's analytic distributed-optimizer state: 2 (BF16 weights) + 4 (FP32 grads) + 8/dp (FP32 master +
    Muon momentum) = 7.00 B/param at dp8; AdamW parameters carry one more moment: + 4 x adamw share / 8."""
    lay = k3opt.Layout.model_validate({**k3opt.load_layout(PROXY).model_dump(), "ep": 1, "expert_fsdp": 8,
                                       "optimizer_shard_granularity": "element", "measured": None})
    ev = k3opt.evaluate(lay)
    st = structure_of(ev.model)
    blocks = [b for layer in [*st.layers, st.first, st.last] for b in layer]
    total = sum(b.params() for b in blocks)
    adam = sum(b.params("adamw") for b in blocks)
    per_param = ev.ranks[0].persistent_bytes / total
    assert per_param == pytest.approx(2 + 4 + 8 / 8 + 4 * adam / total / 8, rel=1e-9)
    assert round(per_param - 4 * adam / total / 8, 2) == 7.00


@pytest.mark.parametrize("policy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_policies_order_memory(reference, model, cluster, policy):
    """Each step of the vocabulary shards one more thing: master/state, then gradients (and their transient)."""
    lay = k3opt.Layout.model_validate({**reference.model_dump(), "dense_sharding": policy,
                                       "expert_sharding": policy})
    r = k3opt.evaluate(lay, model=model, cluster=cluster).ranks[1]
    base = k3opt.evaluate(reference, model=model, cluster=cluster).ranks[1]
    whole = base.ledger["bf16_view"] / 2  # D + E/e parameters of the rank
    if policy == "no_shard":
        assert r.ledger["master"] == pytest.approx(4 * whole, abs=2)
    else:
        assert r.ledger["master"] == base.ledger["master"]
    if policy in ("no_shard", "optim"):
        # A whole buffer accumulates in place: no unsharded BF16 gradient before a reduce-scatter, only the two
        # BF16 [T, d] gradient streams (2 x 56 MiB).
        assert r.ledger["grads"] == pytest.approx(4 * whole, abs=2)
        assert r.ledger["grad_transient"] == 2 * 4096 * 7168 * 2
    else:
        assert r.ledger["grads"] == base.ledger["grads"]
    assert r.ledger["bf16_view"] == base.ledger["bf16_view"]


def test_bf16_grads_and_state_halve_their_terms(reference, model, cluster):
    lay = k3opt.Layout.model_validate({**reference.model_dump(), "grad_dtype": "bf16",
                                       "optimizer_state_dtype": "bf16"})
    r = k3opt.evaluate(lay, model=model, cluster=cluster).ranks[1]
    base = k3opt.evaluate(reference, model=model, cluster=cluster).ranks[1]
    assert r.ledger["grads"] == pytest.approx(base.ledger["grads"] / 2, abs=1)
    assert r.ledger["optimizer"] == pytest.approx(base.ledger["optimizer"] / 2, abs=1)


def test_ping_pong_is_megatrons_docstring_example():
    """Megatron's shard_params docstring: 4 ranks, p0-p9 after sorting -> [[p0, p7, p8], [p1, p6, p9], [p2, p5],
    [p3, p4]]. With p_i of i + 1 elements: 1 + 8 + 9 = 18, 2 + 7 + 10 = 19, 3 + 6 = 9, 4 + 5 = 9; given in reverse
    order, the sort puts them back."""
    got = ping_pong([(n, True, 1) for n in range(10, 0, -1)], 4)
    assert [m for m, _ in got] == [18, 19, 9, 9] and all(a == 0 for _, a in got)
    assert ping_pong([(5, False, 1), (3, True, 1)], 2) == ((3, 0), (0, 5))
    # A run of copies: 11 of size 1 then one of size 100 over 4 ranks (loop 0 1 2 3 3 2 1 0): positions 0-7 give
    # each rank 2, positions 8-10 go to ranks 0, 1, 2 and position 11 (the 100) to rank 3.
    assert ping_pong([(100, True, 1), (1, True, 11)], 4) == ((3, 0), (3, 0), (3, 0), (102, 0))


def test_whole_tensor_owner_bounds(model):
    """The ping-pong deal hands every rank one tensor per pass of n, so the worst rank owns at least the average
    and at most the average plus the largest tensor; every element is owned once."""
    st = structure_of(model)
    blocks = tuple(range(0, 12))
    tensors = [n for i in blocks for n, _, k in framework_tensors(st.layers[i], False, 64, model.hidden_size)
               for _ in range(k)]
    assert len(tensors) > 64 and max(tensors) == 2 * 33792 * 7168  # layer 0's fused dense gate + up
    m, a = worst_owned(model, blocks, False, 64, 64)
    avg = sum(tensors) / 64
    assert avg <= m + a <= avg + max(tensors)
    assert sum(x + y for x, y in count_owned_per_rank(model, blocks, False, 64, 64)) == sum(tensors)


def test_explain_and_validate_cli():
    out = CliRunner().invoke(main, ["validate"])
    assert out.exit_code == 0, out.output
    assert "k3-gb200-512-reference" in out.output and PROXY in out.output and "GAP" in out.output
    assert "reserved" in out.output and "device" in out.output and "allocated" in out.output
    assert CliRunner().invoke(main, ["explain", PROXY]).exit_code == 0


def _policy_eval(policy: str, lifecycle: str = "per_microbatch") -> k3opt.Evaluation:
    """K3 on 64 GPUs of one NVLink domain (PP8, EP8, dense shard group 8, expert group 1): every collective is on
    NVLink, where a reduce-scatter or all-gather of S bytes over n ranks moves S (1 - 1/n) per rank."""
    return k3opt.evaluate(k3opt.make_layout(
        gpus=64, pp=8, ep=8, dense_fsdp=8, microbatches=8, split=[12] * 7 + [9], recompute="full",
        fsdp_lifecycle=lifecycle, dense_sharding=policy, expert_sharding=policy))


def test_sharding_policies_price_their_collectives():
    """The policies trade memory for traffic, and the step time prices it. With FP32 gradients and D dense
    parameters on a rank (expert group of one rank: nothing to reduce there):
    optim_grads reduce-scatters 4 D (1 - 1/8) every microbatch; optim reduce-scatters the whole buffer once per
    update, the same 4 D (1 - 1/8); no_shard all-reduces it, twice that, and gathers no BF16 weights (optim does,
    2 D (1 - 1/8)). The whole buffer is 4 D (1 - 1/8) larger than the shard, so that ledger difference is the
    byte count."""
    sharded, whole, none = _policy_eval("optim_grads"), _policy_eval("optim"), _policy_eval("no_shard")
    nvlink = k3opt.load_cluster("gb200-nvl72").nvlink_gbps * 1e9
    for r in range(8):
        a, b, c = sharded.ranks[r], whole.ranks[r], none.ranks[r]
        moved = b.ledger["grads"] - a.ledger["grads"]          # 4 D - 4 D / 8
        assert moved > 0
        assert a.time_s["nvlink"] - b.time_s["nvlink"] == pytest.approx(moved / nvlink, rel=1e-9)
        assert b.update_s["nvlink"] - a.update_s["nvlink"] == pytest.approx(moved / nvlink, rel=1e-9)
        # no_shard: all-reduce 2 x 4 D (7/8) instead of reduce-scatter 4 D (7/8) + BF16 all-gather 2 D (7/8).
        assert c.update_s["nvlink"] - b.update_s["nvlink"] == pytest.approx(moved / 2 / nvlink, rel=1e-9)
        # no_shard orthogonalizes every dense matrix itself: 8 x the dense Newton-Schulz FLOPs of a shard.
        dense_ns = b.counts["newton_schulz_flops"] - b.counts["newton_schulz_routed_flops"]
        assert c.counts["newton_schulz_flops"] - c.counts["newton_schulz_routed_flops"] == pytest.approx(8 * dense_ns)
    # Here the tensor cores bind the optimistic step, so only the serial bound (resources summed) shows the trade:
    # the per-microbatch reduce-scatter repeats on each of the M + p - 1 = 15 slots, the per-update one once.
    assert sharded.step.serial_step_time_s > whole.step.serial_step_time_s


def test_bf16_gradients_halve_the_reduction():
    """BF16 gradient buffers reduce-scatter 2 B per parameter instead of 4: half the per-microbatch traffic."""
    fp32 = _policy_eval("optim_grads")
    bf16 = k3opt.evaluate(k3opt.Layout.model_validate({**fp32.layout.model_dump(), "grad_dtype": "bf16"}))
    base = _policy_eval("optim")
    nvlink = k3opt.load_cluster("gb200-nvl72").nvlink_gbps * 1e9
    r32, r16, rb = fp32.ranks[3], bf16.ranks[3], base.ranks[3]
    moved32 = rb.ledger["grads"] - r32.ledger["grads"]
    assert r32.time_s["nvlink"] - r16.time_s["nvlink"] == pytest.approx(moved32 / 2 / nvlink, rel=1e-9)


# Sharding policies, whole-tensor ownership and the validation rows, pinned where a figure or a printed formula could
# change unnoticed: the term formulas per policy / dtype / granularity (they name which degree divides each term), the
# state of the rank owning the most whole tensors against the parameter inventory of seed 003's 4-layer proxy, and the
# like-with-like memory comparisons (which rank, which kind, which unit).

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
    seed003 = _policy_formulas(proxy, _params(proxy))  # optim / optim, tensor granularity, FP32 / FP32
    assert seed003 == {
        "master": "FP32 masters of the rank owning the most whole tensors: 4 x (D/f_d + E/e/f_e) "
                  "(dense optim, expert optim)",
        "grads": "FP32 gradients: 4 x (D + E/e) (dense optim, expert optim; unsharded = the whole buffer)",
        "optimizer": "Muon momentum 4 B + AdamW moments 8 B per owned parameter of the rank owning the most "
                     "whole tensors",
        "optimizer_transient": TRANSIENT}
    mixed = _variant(proxy, dense_sharding="optim_grads", expert_sharding="no_shard",
                     optimizer_shard_granularity="element", grad_dtype="bf16", optimizer_state_dtype="bf16")
    assert _policy_formulas(mixed, _params(proxy)) == {
        "master": "FP32 masters: 4 x (D/f_d + E/e) (dense optim_grads, expert no_shard)",
        "grads": "BF16 gradients: 2 x (D/f_d + E/e) (dense optim_grads, expert no_shard; unsharded = the whole "
                 "buffer)",
        "optimizer": "Muon momentum 2 B + AdamW moments 4 B per owned parameter",
        # BF16 gradients: the step copies the owned shard to FP32 for the FP32 main parameters
        "optimizer_transient": TRANSIENT + "; plus the FP32 copy of the BF16 gradient shard the rank owns, 4 x owned "
                                           "params"}
    swapped = _variant(proxy, dense_sharding="no_shard", expert_sharding="optim_grads_params",
                       optimizer_shard_granularity="element")
    f = _policy_formulas(swapped, _params(proxy))
    assert f["master"] == "FP32 masters: 4 x (D + E/e/f_e) (dense no_shard, expert optim_grads_params)"
    assert f["grads"] == ("FP32 gradients: 4 x (D + E/e/f_e) (dense no_shard, expert optim_grads_params; "
                          "unsharded = the whole buffer)")


def _params(lay):  # noqa: ANN001, ANN202 - the proxy's parameter counts: Muon matrices and AdamW tensors both
    return k3opt.evaluate(lay).params


@pytest.mark.parametrize("fields", [
    {"optimizer_shard_granularity": "tensor"}, {"grad_dtype": "bf16"}, {"optimizer_state_dtype": "bf16"},
    {"expert_sharding": "optim"}, {"dense_sharding": "optim_grads"}])
def test_any_one_non_default_choice_replaces_the_default_formulas(proxy, fields):
    """The default (optim_grads_params both, element, FP32 / FP32) keeps TERM_INFO's formulas; changing any one
    of the five choices prints the policy formulas."""
    default = dict(dense_sharding="optim_grads_params", expert_sharding="optim_grads_params",
                   optimizer_shard_granularity="element", grad_dtype="fp32", optimizer_state_dtype="fp32")
    assert _policy_formulas(_variant(proxy, **default), _params(proxy)) == {}
    changed = _policy_formulas(_variant(proxy, **{**default, **fields}), _params(proxy))
    assert set(changed) == {"master", "grads", "optimizer", "optimizer_transient"}


def test_evaluate_prints_the_policy_formulas(proxy):
    ev = k3opt.evaluate(proxy)
    terms = {t.key: t.formula for t in ev.ranks[0].terms}
    assert {k: terms[k] for k in ("master", "grads", "optimizer")} == {
        k: v for k, v in _policy_formulas(proxy, _params(proxy)).items() if k != "optimizer_transient"}


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


# Whole-tensor sharding: the HBM check keeps the data-parallel rank owning the most bytes, and which rank that is
# depends on the byte widths of what it owns. On seed 003's 4-layer proxy, a stage holding layer 1 alone, dealt over a
# dense group of 3 ranks, has two candidate ranks that trade places: one owns a little more Muon, the other more AdamW.
# The expected states are built from the ranks' (Muon, AdamW) element counts (k3opt.cost.sharding's deal, pinned against
# the seed's tensor inventory in test_golden and by the ownership tests above) and the widths of each state.

# Bytes per owned element: FP32 master 4 + FP32 Muon momentum 4 (AdamW: two FP32 moments, 8) + the FP32 gradient
# shard 4 where the policy shards gradients (optim_grads), nothing where the gradient buffer is whole (optim).
WIDTHS = {"optim_grads": (4 + 4 + 4, 4 + 8 + 4), "optim": (4 + 4, 4 + 8)}


def _proxy_pp3_coefficients(policy: str):
    """Proxy on 9 GPUs: PP3 with split 1 / 1 / 2, dense FSDP 3 (one rank per dp index), EP 1, expert FSDP 1."""
    lay = k3opt.make_layout(gpus=9, pp=3, ep=1, dense_fsdp=3, expert_fsdp=1, microbatches=3, context=4096,
                            split=[1, 1, 2], dense_sharding=policy, expert_sharding=policy,
                            optimizer_shard_granularity="tensor")
    model = k3opt.load_model("kimi-k3-4layer-proxy")
    return coefficients(Shape.of(lay), model, k3opt.load_cluster("gb200-nvl72"))


def _worst(policy: str) -> tuple[int, int]:
    cf = _proxy_pp3_coefficients(policy)
    wm, wa = WIDTHS[policy]
    return max(cf.cost.owned_per_rank((1,), False, 3, 1), key=lambda s: wm * s[0] + wa * s[1])


def test_the_two_candidate_ranks_trade_places_between_policies():
    """12 B / 16 B per Muon / AdamW element (optim_grads) keep the rank with more Muon; 8 B / 12 B (optim) the rank
    with more AdamW: the widths, not the element count alone, decide."""
    a, b = _worst("optim_grads"), _worst("optim")
    assert a != b
    assert a[0] > b[0] and a[1] < b[1]


@pytest.mark.parametrize("policy", ["optim_grads", "optim"])
def test_stage_state_is_the_worst_owners(policy):
    """Stage 1 (layer 1) of the layout: master 4 B and state 4 B (Muon) / 8 B (AdamW) per element of the worst
    dense rank plus the lone expert rank's whole share; gradients: the owned elements under optim_grads, the whole
    stage's parameters under optim (4 B each)."""
    cf = _proxy_pp3_coefficients(policy)
    wm, wa = WIDTHS[policy]
    dense = max(cf.cost.owned_per_rank((1,), False, 3, 1), key=lambda s: wm * s[0] + wa * s[1])
    (expert,) = cf.cost.owned_per_rank((1,), True, 1, 1)
    got = _tensor_owned_state(cf, (1,))
    assert got["master"] == 4 * (dense[0] + dense[1] + expert[0] + expert[1])
    assert got["optimizer"] == 4 * (dense[0] + expert[0]) + 8 * (dense[1] + expert[1])
    if policy == "optim_grads":
        assert got["grads"] == 4 * (dense[0] + dense[1] + expert[0] + expert[1])
    else:
        assert got["grads"] == 4 * (cf.cost.whole_params((1,), False, 1) + cf.cost.whole_params((1,),
                                                                                                True, 1))


@pytest.mark.parametrize("group", [12, 24])
def test_k3_stage_of_three_layers_keeps_the_owner_of_the_most_bytes(group):
    """K3, a stage holding layers 1-3 (PP3, split 1 / 3 / 89), dense FSDP 12 and 24 under optim_grads: near-ties
    between ranks whose Muon and AdamW shares differ, settled by 12 B per Muon and 16 B per AdamW element."""
    lay = k3opt.make_layout(gpus=3 * group, pp=3, ep=1, dense_fsdp=group, expert_fsdp=1, microbatches=3,
                            context=4096, split=[1, 3, 89], dense_sharding="optim_grads",
                            expert_sharding="optim_grads", optimizer_shard_granularity="tensor")
    cf = coefficients(Shape.of(lay), k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72"))
    idx = (1, 2, 3)
    dense = max(cf.cost.owned_per_rank(idx, False, group, 1), key=lambda s: 12 * s[0] + 16 * s[1])
    (expert,) = cf.cost.owned_per_rank(idx, True, 1, 1)
    got = _tensor_owned_state(cf, idx)
    assert got["master"] == 4 * (dense[0] + dense[1] + expert[0] + expert[1])
    assert got["optimizer"] == 4 * (dense[0] + expert[0]) + 8 * (dense[1] + expert[1])


# Whole-tensor sharding with BF16 optimizer state and whole gradients (optim): the HBM check keeps the dense rank owning
# the most bytes at 4 B master + 2 B Muon momentum (6 B) per Muon element and 4 + 2 x 2 B AdamW moments (8 B) per AdamW
# element, the gradient buffer being whole and so not owned. On K3, a stage of layers 81-83 dealt over a dense group of
# 16 has two candidate ranks about 16 KiB apart at those widths that trade places at any other (7 B / 9 B, one byte more
# each): the widths, not the element count, decide. The ranks' (Muon, AdamW) element counts are k3opt.cost.sharding's
# deal, pinned against the seed's tensor inventory in test_golden and by the ownership tests above.

IDX = (81, 82, 83)  # stage 1 of PP3 with split 81 / 3 / 9 (K3's 93 decoder layers)
MUON, ADAMW = 4 + 2, 4 + 2 * 2  # bytes per owned element: FP32 master + BF16 state (one momentum / two moments)


def _k3_bf16_state_coefficients():
    lay = k3opt.make_layout(gpus=48, pp=3, ep=1, dense_fsdp=16, expert_fsdp=1, microbatches=3, context=4096,
                            split=[81, 3, 9], dense_sharding="optim", expert_sharding="optim",
                            optimizer_shard_granularity="tensor", optimizer_state_dtype="bf16")
    return coefficients(Shape.of(lay), k3opt.load_model("kimi-k3"), k3opt.load_cluster("gb200-nvl72"))


def test_bf16_state_keeps_the_dense_rank_owning_the_most_bytes():
    cf = _k3_bf16_state_coefficients()
    shares = cf.cost.owned_per_rank(IDX, False, 16, 1)
    dense = max(shares, key=lambda s: MUON * s[0] + ADAMW * s[1])
    # The case is a near-tie: one more byte per element would keep another rank (so the widths are what is tested).
    assert max(shares, key=lambda s: (MUON + 1) * s[0] + (ADAMW + 1) * s[1]) != dense
    (expert,) = cf.cost.owned_per_rank(IDX, True, 1, 1)  # expert FSDP 1: one rank owns every expert tensor
    got = _tensor_owned_state(cf, IDX)
    assert got["master"] == 4 * (dense[0] + dense[1] + expert[0] + expert[1])
    assert got["optimizer"] == 2 * (dense[0] + expert[0]) + 4 * (dense[1] + expert[1])
    # optim: the FP32 gradient buffer stays whole, every parameter of the stage (4 B each).
    assert got["grads"] == 4 * (cf.cost.whole_params(IDX, False, 1) + cf.cost.whole_params(IDX, True, 1))


# Memory comparisons on one stated data-parallel rank under whole-tensor sharding (seed 003's 4-layer proxy, a dense
# shard group of 8): a rank past the group is a clear error, and without lazy optimizer state the figure before the
# first step is the resident state itself.

@pytest.fixture(scope="module")
def eager_proxy() -> k3opt.Evaluation:
    """The proxy with its optimizer state allocated eagerly (the seed's run allocates it lazily)."""
    proxy = k3opt.load_layout("k3-4layer-dist-muon-8gpu")
    return k3opt.evaluate(k3opt.Layout.model_validate({**proxy.model_dump(), "lazy_optimizer_state": False}))


def test_a_data_parallel_rank_past_the_shard_group_is_an_error(eager_proxy):
    """DP ranks 0-7 exist in a group of 8; rank 8 names no rank."""
    with pytest.raises(LayoutError) as err:
        memory_comparisons(Measured(dp_rank=8, resident_gib=100.0), eager_proxy.ranks)
    assert str(err.value) == "measured.dp_rank = 8: the shard groups have 8 ranks"


def test_eager_state_is_resident_before_the_first_step_on_any_dp_rank(eager_proxy):
    """Eager optimizer state: before the first step the rank already holds everything it holds after it, so the
    two figures agree on every DP rank, also on rank 0, whose owned optimizer state differs from the worst
    owner's (the ledger's)."""
    r = eager_proxy.ranks[0]
    mine = r.counts["owned_per_dp_rank"][0]
    assert mine["optimizer"] != r.ledger["optimizer"]
    rows = memory_comparisons(Measured(dp_rank=0, resident_gib=100.0, pre_step_resident_gib=100.0),
                              eager_proxy.ranks)
    assert [c.figure for c in rows] == ["resident state, PP rank 0, DP rank 0",
                                        "resident before the first step, PP rank 0, DP rank 0"]
    assert rows[1].modeled == rows[0].modeled


# Which rank a whole-tensor memory figure is compared on, as the validation row names it: seed 003's proxy (dist_muon,
# tensor granularity, the 'K3 memory lab' measurement) read on a stated DP rank says so; without a stated DP rank the
# figures are the ledger's, the rank owning the most whole tensors ('worst owner'); element granularity has no owner to
# name.

def _figures_without_a_dp_rank(**fields) -> list[str]:
    base = k3opt.load_layout(PROXY)
    data = base.model_dump()
    data["measured"] = {**data["measured"], "dp_rank": None}
    data.update(fields)
    ev = k3opt.evaluate(k3opt.Layout.model_validate(data))
    return [c.figure for c in ev.validation if c.kind]


def test_an_unstated_dp_rank_is_compared_on_the_worst_owner():
    assert _figures_without_a_dp_rank() == [
        "resident state, PP rank 0, worst owner",
        "resident before the first step, PP rank 0, worst owner",
        "grads, PP rank 0, worst owner",
        "master, PP rank 0, worst owner",
        "optimizer, PP rank 0, worst owner",
        "bf16_view, PP rank 0, worst owner",
        "optimizer-step transient, PP rank 0, worst owner"]


def test_element_granularity_names_no_owner():
    assert _figures_without_a_dp_rank(optimizer_shard_granularity="element")[0] == "resident state, PP rank 0"
