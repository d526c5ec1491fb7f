"""Sharding policies as layout fields (Megatron's vocabulary), whole-tensor optimizer ownership, lazy optimizer
state, and seed 003's reconciliations (the K3 activation-model review, dist_muon on a 4-layer proxy)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import k3opt
from k3opt.cli import main
from k3opt.cost.sharding import framework_tensors, owned_per_rank, ping_pong, worst_owned
from k3opt.cost.structure import structure_of
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
    m, a = worst_owned(model.model_dump_json(), blocks, False, 64, 64)
    avg = sum(tensors) / 64
    assert avg <= m + a <= avg + max(tensors)
    assert sum(x + y for x, y in owned_per_rank(model.model_dump_json(), blocks, False, 64, 64)) == sum(tensors)


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
