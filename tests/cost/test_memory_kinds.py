"""Measurement kinds (allocated / reserved / device), the runtime preset's items outside the ledger, the HBM
constraint on device, and the budget the search uses. Expected values are derived here from the sources the
runtime preset cites, step by step."""

from __future__ import annotations

import pytest

import k3opt
from k3opt.cost.coefficients import Shape
from k3opt.cost.memory_outside import allocated_budget_bytes, allocated_budgets_bytes, kinds, runtime_items
from k3opt.inputs.presets import load_runtime
from k3opt.inputs.specs import RuntimeSpec

GIB, MIB = 2**30, 2**20
RT = "megatron-te-hybridep-gb200"
# The default job's best plan on the live-tensor ledger (README): 178.74 GiB on rank 0, 8 racks x 64 GPUs.
PLAN = dict(gpus=512, pp=8, ep=64, dense_fsdp=64, microbatches=64, split=[9, 9, 10, 11, 12, 14, 14, 14],
            recompute="selective", domain_gpus_used=64,
            toggles=dict(fp8_activations=True, moe_backward_rewrite=True, dispatch_recompute=True, fused_situ=True))


@pytest.fixture(scope="module")
def rt() -> RuntimeSpec:
    return load_runtime(RT)


def _items(ev, rank=0):
    return {i.key: i for i in ev.ranks[rank].memory_items}


def test_nccl_connection_is_10_mib(rt):
    # Simple 4 MiB (1 << 22) + LL 8*512*8*16 = 512 KiB + LL128 120*640*8*8 = 4,915,200 B = 9,633,792 B,
    # rounded up to the 2 MiB cuMem granularity: 5 x 2 MiB = 10,485,760 B (the allocations of NVIDIA/nccl #1685).
    assert rt.nccl_ll_buffer_bytes == 8 * 512 * 8 * 16
    assert rt.nccl_ll128_buffer_bytes == 120 * 640 * 8 * 8
    assert rt.nccl_connection_bytes == 10_485_760


def test_cublas_and_te_workspaces_are_allocated_kind(rt):
    # cuBLAS ":4096:2:16:8" = 2 x 4096 KiB + 8 x 16 KiB = 8,320 KiB; TE 32 MiB + 1 KiB for cc >= 9, 5 of them.
    assert rt.cublas_workspace_bytes == (2 * 4096 + 8 * 16) * 1024
    assert rt.te_workspace_bytes == 32 * MIB + 1024


def test_reference_kinds_add_up(reference_eval, rt):
    """allocated = ledger peak + workspaces; reserved = allocated x 1.1333; device = reserved + outside."""
    r0 = reference_eval.ranks[0]
    ws = 8_519_680 + 5 * (32 * MIB + 1024)
    assert r0.allocated_bytes == r0.peak_bytes + ws
    assert r0.reserved_bytes == r0.allocated_bytes + round(r0.allocated_bytes * 0.1333)
    outside = sum(i.bytes for i in r0.memory_items if i.where == "outside")
    assert r0.device_bytes == r0.reserved_bytes + outside
    assert r0.fits == (r0.device_bytes <= reference_eval.capacity_bytes)


def test_reference_ledger_unchanged_112_59(reference_eval):
    """The live-tensor ledger of the default policy is today's: 112.59 GiB on rank 0 (README)."""
    assert round(reference_eval.peak_bytes / GIB, 2) == 112.59
    assert reference_eval.layout.runtime == RT


def test_hybridep_buffer_ep64_in_one_domain(model, cluster, rt):
    """HybridEP at EP64 inside one NVLink domain, T = 4096: max tokens = 4096 x 64 ranks x 1 domain = 262,144;
    K3 dispatches the 3,584-wide latent in BF16: 262,144 x 3584 x 2 = 1.75 GiB (the note's 3.5 GiB is for a
    7,168-wide BF16 token); probs 262,144 x (14 experts x 64 ranks) x 4 B = 0.875 GiB."""
    ev = k3opt.evaluate(k3opt.make_layout(**PLAN, runtime=RT))
    assert _items(ev)["hybridep_buffers"].bytes == 262_144 * 3584 * 2 + 262_144 * 896 * 4
    assert _items(ev)["hybridep_buffers"].bytes == int(1.75 * GIB + 0.875 * GIB)


def test_nvls_knob_and_collectives(model, cluster, rt):
    """With 64 GPUs per domain the dense FSDP64 and EP64 groups are each inside one domain: two NVLS
    communicators of 32 channels x 2 x 128 KiB x 8 steps x 8 heads = 512 MiB; NCCL_NVLS_ENABLE=0 removes them."""
    on = k3opt.evaluate(k3opt.make_layout(**PLAN), runtime=rt)
    off = k3opt.evaluate(k3opt.make_layout(**PLAN), runtime=rt.model_copy(update={"nccl_nvls_enable": False}))
    assert _items(on)["nccl_nvls"].bytes == 2 * 512 * MIB
    assert _items(off)["nccl_nvls"].bytes == 0
    assert on.ranks[0].device_bytes - off.ranks[0].device_bytes == 2 * 512 * MIB
    # Three collective communicators (dense shard 64, EP 64, the world group over which the distributed optimizer
    # reduces the gradient norm) x 16 channels x 10 MiB.
    assert _items(on)["nccl_collectives"].bytes == 3 * 16 * 10 * MIB
    assert "world (gradient norm) 512" in _items(on)["nccl_collectives"].formula


def test_a_stage_inside_one_domain_gets_its_local_buffers(reference, model, cluster, rt):
    """The reference (512 GPUs, whole 72-GPU domains): PP rank 0 holds global ranks 0-63, all in the first domain,
    so its dense shard 64 and EP 64 groups are NVLink-local (two NVLS communicators, 2 x 512 MiB) and its HybridEP
    probabilities span 64 ranks: 4096 x 64 tokens x (896 / 64 experts x 64 ranks) x 4 B = 0.875 GiB, beside the
    token buffer 4096 x 64 x 3584 x 2 B = 1.75 GiB. Rank 1 (ranks 64-127) straddles the domain boundary at 72:
    8 of its EP ranks sit in the first domain, so no NVLS and probabilities over 8 ranks."""
    ev = k3opt.evaluate(reference, model=model, cluster=cluster, runtime=rt)
    r0, r1 = _items(ev, 0), _items(ev, 1)
    assert r0["nccl_nvls"].bytes == 2 * 512 * MIB and r1["nccl_nvls"].bytes == 0
    token = 4096 * 64 * 3584 * 2
    assert r0["hybridep_buffers"].bytes == token + 4096 * 64 * 14 * 64 * 4
    assert r1["hybridep_buffers"].bytes == token + 4096 * 64 * 14 * 8 * 4


def test_pp_p2p_peers_edge_and_interior(rt):
    """PP send/recv inside a domain: 16 channels x 512 KiB x 8 steps = 64 MiB per peer; rank 0 has one peer."""
    lay = k3opt.make_layout(gpus=64, pp=8, ep=8, dense_fsdp=8, microbatches=8, split=[12] * 7 + [9])
    ev = k3opt.evaluate(lay, runtime=rt)
    assert _items(ev, 0)["nccl_p2p"].bytes == 64 * MIB
    assert _items(ev, 3)["nccl_p2p"].bytes == 2 * 64 * MIB


def test_fits_is_device_against_hbm_minus_reserve(rt):
    """The default plan fits on live tensors (178.74 < 181.03 GiB) but its device peak does not."""
    lay = k3opt.make_layout(**PLAN, reserve_gib=1.0)
    bare = k3opt.evaluate(lay)
    ev = k3opt.evaluate(lay, runtime=rt)
    assert bare.fits and bare.peak_device_bytes == bare.peak_bytes  # no runtime: live tensors only
    assert not ev.fits and ev.peak_bytes == bare.peak_bytes
    assert ev.headroom_bytes == ev.capacity_bytes - ev.peak_device_bytes < 0


def test_budget_is_tight_and_matches_evaluate(model, cluster, rt):
    lay = k3opt.make_layout(**PLAN, reserve_gib=1.0)
    shape = Shape.of(lay)
    cap = cluster.hbm_bytes - GIB
    budgets = allocated_budgets_bytes(shape, model, cluster, 1.0, rt)
    assert allocated_budget_bytes(shape, model, cluster, 1.0, rt) == min(budgets)
    for r, b in enumerate(budgets):
        items = runtime_items(shape, model, cluster, rt, r)
        assert kinds(b, items, rt)[2] <= cap < kinds(b + 2, items, rt)[2]
    ev = k3opt.evaluate(lay, runtime=rt)
    assert all((r.peak_bytes <= budgets[r.rank]) == r.fits for r in ev.ranks)
    # Without a runtime the budget is the plain HBM line minus the reserve.
    assert allocated_budget_bytes(shape, model, cluster, 1.0, None) == cap


def test_expandable_segments_needs_its_own_slack(tmp_path):
    text = k3opt.inputs.presets.resolve(RT, "runtime").read_text().replace(
        "expandable_segments = false", "expandable_segments = true")
    p = tmp_path / "rt.toml"
    p.write_text(text)
    with pytest.raises(k3opt.SpecError, match="allocator_slack_expandable_segments"):
        load_runtime(p)


def test_the_expandable_variant_changes_only_the_allocator():
    """megatron-te-hybridep-gb200-expandable names its base and changes the allocator flag and its slack: Megatron-
    Bridge's 8 x GB200 Nemotron 3.5 Lightning perf run (expandable segments on) reserved 161.260 GiB at 156.850 GiB
    allocated, 2.81%; the card's largest GB200 figure, 166.23 / 160.76 - 1 = 3.40%, is taken."""
    base, es = load_runtime(RT), load_runtime(f"{RT}-expandable")
    assert es.expandable_segments and es.slack == pytest.approx(round(166.23 / 160.76 - 1, 3))
    keep = {"name", "description", "expandable_segments", "allocator_slack_expandable_segments", "source"}
    assert es.model_dump(exclude=keep) == base.model_dump(exclude=keep)
    # The allocator's slack is the only difference in the reserved line: reserved = allocated x (1 + slack).
    lay = k3opt.make_layout(**PLAN, reserve_gib=1.0)
    a, b = k3opt.evaluate(lay, runtime=base).ranks[0], k3opt.evaluate(lay, runtime=es).ranks[0]
    assert a.allocated_bytes == b.allocated_bytes
    assert b.reserved_bytes == pytest.approx(b.allocated_bytes * 1.034, rel=1e-9)
    assert a.reserved_bytes == pytest.approx(a.allocated_bytes * 1.1333, rel=1e-9)


@pytest.mark.parametrize(("base", "words"), [
    ('"nope"', "unknown runtime preset 'nope'"),
    ("3", "base must be a runtime preset name or file"),
])
def test_a_runtime_with_a_bad_base_is_one_line(tmp_path, base: str, words: str):
    p = tmp_path / "rt.toml"
    p.write_text(f"base = {base}\nname = \"mine\"\n")
    with pytest.raises((k3opt.SpecError, k3opt.PresetNotFoundError), match=words):
        load_runtime(p)


def test_a_base_that_names_a_base_is_refused(tmp_path):
    first = tmp_path / "first.toml"
    first.write_text(f'base = "{RT}"\nname = "first"\n')
    second = tmp_path / "second.toml"
    second.write_text(f'base = "{first}"\nname = "second"\n')
    assert load_runtime(first).name == "first"
    with pytest.raises(k3opt.SpecError, match="names a base itself"):
        load_runtime(second)


def test_unknown_runtime_preset():
    with pytest.raises(k3opt.PresetNotFoundError, match="unknown runtime preset 'nope'; known presets: megatron"):
        load_runtime("nope")


def test_plan_frame_carries_the_three_kinds_per_rank(rt):
    from types import SimpleNamespace

    from k3opt.search.result import plan_frame

    lay = k3opt.make_layout(**PLAN, reserve_gib=1.0, runtime=RT)
    ev = k3opt.evaluate(lay)
    df = plan_frame([SimpleNamespace(layout=lay, evaluation=ev)])
    row = df.iloc[0]
    assert row["peak_device_gib"] == pytest.approx(ev.peak_device_bytes / GIB)
    assert row["rank7_reserved_gib"] == pytest.approx(ev.ranks[7].reserved_bytes / GIB)
    assert row["runtime"] == RT and row["dense_sharding"] == "optim_grads_params"


def test_validate_rows_json_and_bad_folder(tmp_path):
    import json

    from click.testing import CliRunner

    from k3opt.cli import main

    rows = json.loads(CliRunner().invoke(main, ["validate", "--json"]).output)
    ref = [r for r in rows if r["layout"] == "k3-gb200-512-reference"]
    assert [r["kind"] for r in ref] == ["reserved", "device"]
    for r in rows:
        assert r["gap"] == pytest.approx(r["measured"] - r["modeled"])
        assert r["gap_pct"] == pytest.approx(100 * r["gap"] / r["measured"])
    (tmp_path / "bad.toml").write_text('gpus = "512"\n')
    result = CliRunner().invoke(main, ["validate", "--folder", str(tmp_path)])
    assert result.exit_code == 2 and result.output.startswith("k3opt: error:") and "gpus" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_cp_ring_and_nccl_all_to_all_peers(rt):
    """CP2: one ring neighbour inside the domain, 64 MiB. Without HybridEP the EP8 all-to-all runs over NCCL:
    seven more NVLink peers, 7 x 64 MiB, and no HybridEP buffer."""
    lay = k3opt.make_layout(gpus=64, pp=1, cp=2, ep=8, dense_fsdp=8, split=[93])
    ev = k3opt.evaluate(lay, runtime=rt)
    assert _items(ev)["nccl_p2p"].bytes == 64 * MIB
    nccl_a2a = k3opt.evaluate(lay, runtime=rt.model_copy(update={"hybridep": False}))
    assert _items(nccl_a2a)["nccl_p2p"].bytes == 8 * 64 * MIB
    assert _items(nccl_a2a)["hybridep_buffers"].bytes == 0 < _items(ev)["hybridep_buffers"].bytes


# HybridEP's buffers as evaluate() prices them from the runtime preset (2 B per dispatched value, 4 B per routing
# probability), only on the ranks that hold MoE layers, and the runtime's items in evaluate()'s dict, on figures worked
# out from the layer shapes.

def _item_bytes(rank) -> dict[str, int]:
    return {i.key: i.bytes for i in rank.memory_items}


def test_hybridep_buffers_only_on_ranks_holding_moe_layers():
    """DeepSeek-V3, PP 2 split 3 / 58: rank 0 holds the three dense layers only (no EP all-to-all, no HybridEP
    buffer); rank 1 holds the MoE layers. Its buffer: T = 4,096 tokens x 8 EP ranks in one domain = 32,768
    tokens; x 7,168 (no latent: the hidden state is dispatched) x 2 B = 469,762,048 B, plus probabilities
    32,768 x (256 / 8 = 32 experts x 8 ranks) x 4 B = 33,554,432 B: 503,316,480 B."""
    lay = k3opt.make_layout(gpus=16, pp=2, ep=8, dense_fsdp=8, expert_fsdp=1, microbatches=4, context=4096,
                            split=[3, 58], recompute="full")
    ev = k3opt.evaluate(lay, model="deepseek-v3", cluster="gb200-nvl72", runtime=RT)
    assert ev.ranks[0].counts["moe_layers"] == 0
    assert _item_bytes(ev.ranks[0])["hybridep_buffers"] == 0
    assert _item_bytes(ev.ranks[1])["hybridep_buffers"] == 32_768 * 7168 * 2 + 32_768 * 32 * 8 * 4 == 503_316_480
    # Split 4 / 57: rank 0 now holds layer 3, its one MoE layer, and the same buffer.
    one = k3opt.evaluate(lay.model_copy(update={"split": [4, 57]}), model="deepseek-v3", cluster="gb200-nvl72",
                         runtime=RT)
    assert one.ranks[0].counts["moe_layers"] == 1
    assert _item_bytes(one.ranks[0])["hybridep_buffers"] == 503_316_480


def test_hybridep_buffer_of_a_model_without_latent_moe():
    """Qwen3-30B-A3B measured layout (mb-20): 4 rows x 4,096 = 16,384 tokens x 8 EP ranks = 131,072 tokens;
    x 2,048 (the hidden size: Qwen3 has no latent) x 2 B + 131,072 x (128 / 8 = 16 experts x 8) x 4 B."""
    lay = k3opt.load_layout("layouts/measured/mb-20-qwen3-30b-a3b-gb200.toml")
    ev = k3opt.evaluate(lay, runtime=RT)
    assert _item_bytes(ev.ranks[0])["hybridep_buffers"] == 131_072 * 2048 * 2 + 131_072 * 16 * 8 * 4 == 603_979_776


def test_to_dict_carries_the_runtime_and_its_items():
    lay = k3opt.load_layout("layouts/measured/mb-20-qwen3-30b-a3b-gb200.toml")
    ev = k3opt.evaluate(lay, runtime=RT)
    d = ev.to_dict()
    assert d["runtime"] == RT
    items = d["ranks"][0]["memory_items"]
    assert items["hybridep_buffers"] == {"bytes": 603_979_776, "where": "outside",
                                         "formula": next(i.formula for i in ev.ranks[0].memory_items
                                                         if i.key == "hybridep_buffers")}
    assert k3opt.evaluate(lay.model_copy(update={"runtime": None})).to_dict()["runtime"] is None
