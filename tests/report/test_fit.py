"""`k3opt validate`'s Fit table: each measured run's modeled device peak against its GPU's HBM."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import k3opt
from k3opt.cli import main
from k3opt.report.validate import FitRow, fit_rows, measured_layouts


def test_every_measured_run_has_a_fit_row_on_its_device_line():
    rows = {r.layout: r for r in fit_rows()}
    assert len(rows) == len(measured_layouts())
    ref = rows["k3-gb200-512-reference"]
    # GB200: nvidia-smi's 189,471 MiB; the reference run's device line: 132.83 GiB (explain's DEVICE row, rank 0)
    assert ref.hbm_gib == pytest.approx(189_471 / 1024, abs=1e-9) and ref.fits
    assert ref.device_gib == pytest.approx(132.83, abs=0.005)
    # a layout naming no runtime is judged with its cluster's default (GB200: the HybridEP runtime), B200 has none;
    # one naming a runtime (MB-13's recipe runs expandable segments, and NVLS off) is judged with it
    assert rows["k3-4layer-dist-muon-8gpu"].runtime == "megatron-te-hybridep-gb200" and rows["MB-14"].runtime == "none"
    assert rows["MB-13"].runtime == "megatron-te-hybridep-gb200-expandable-nvls-off"


def test_expandable_segments_bring_mb13_under_its_hbm():
    """MB-13's allocated peak is the same under both runtimes; reserved = allocated x (1 + slack): the 3.4% measured
    with expandable segments (as its recipe runs) against 13.33% without. Both runtimes have NVLS off, as the run
    had, so the slack is their only difference. With its BF16 weights kept beside the MXFP8 ones (no
    fp8_param_gather) the 13.33% takes it over GB200's 185 GiB and the 3.4% does not."""
    lay = k3opt.load_layout("mb-13-deepseek-v3-gb200")
    es = k3opt.evaluate(lay)
    plain = k3opt.evaluate(lay, runtime="megatron-te-hybridep-gb200-nvls-off")
    a, b = max(es.ranks, key=lambda r: r.device_bytes), max(plain.ranks, key=lambda r: r.device_bytes)
    assert a.allocated_bytes == b.allocated_bytes
    assert es.fits and plain.fits
    bf16 = lay.model_copy(update={"fp8_param_gather": False})
    assert k3opt.evaluate(bf16).fits
    assert not k3opt.evaluate(bf16, runtime="megatron-te-hybridep-gb200-nvls-off").fits
    assert b.device_bytes - a.device_bytes == pytest.approx((0.1333 - 0.034) * a.allocated_bytes, rel=1e-9)


def test_a_run_over_its_device_line_but_not_its_live_bytes_runs_only_with_allocator_retries():
    """MB-2 (Llama 3 70B, 64 GB200, no expandable segments) ran. Its device line carries the 13.33% slack measured
    with room to spare; less that slack it is under the HBM, so it is reported as running on allocator retries with
    the fragmentation it leaves room for, not as fitting and not as NO."""
    row = next(r for r in fit_rows() if r.layout == "MB-2")
    assert row.device_gib > row.hbm_gib and not row.fits and row.to_dict()["fits"] is False
    # reserved = allocated x 1.1333: the line without slack is the device line less 0.1333 x allocated
    assert row.floor_gib == pytest.approx(row.device_gib - 0.1333 * row.allocated_gib, abs=1e-6)
    assert row.floor_gib < row.hbm_gib and row.fits_after_cache_release is True
    room = (row.hbm_gib - row.floor_gib) / row.allocated_gib
    assert row.verdict == f"with allocator retries (room for {100 * room:.1f}% fragmentation)"
    out = CliRunner().invoke(main, ["validate"]).output
    fit = out[out.index("Fit:"):]
    line = next(ln for ln in fit.splitlines() if ln.split() and ln.split()[0] == "MB-2")
    assert "with allocator retries" in line


def test_the_fit_verdict_has_three_levels():
    # hand figures: device 202.7 over 185.0; without slack 179.1 under it: (185.0 - 179.1) / 176.7 = 3.3%
    row = FitRow("x", "m", "c", "rt", device_gib=202.7, hbm_gib=185.0, floor_gib=179.1, allocated_gib=176.7)
    assert row.verdict == "with allocator retries (room for 3.3% fragmentation)"
    assert FitRow("x", "m", "c", "rt", 184.0, 185.0, None, 170.0, 160.0).verdict == "yes"
    over = FitRow("x", "m", "c", "rt", 220.0, 185.0, None, 190.0, 185.0)
    assert over.verdict == "NO" and over.fits_after_cache_release is False


def test_a_run_measured_on_other_hardware_claims_no_fit():
    """The dist_muon proxy ran on an MI355X node (seed 003); the GB200 preset only stands in for its allocated
    bytes, so its 229-GiB device line against GB200's 185 GiB says nothing about that run."""
    row = next(r for r in fit_rows() if r.layout == "k3-4layer-dist-muon-8gpu")
    assert row.stand_in_for == "MI355X" and row.fits is None and row.to_dict()["fits"] is None
    assert row.device_gib > row.hbm_gib  # judged on its stand-in it would read NO
    out = CliRunner().invoke(main, ["validate"]).output
    fit = out[out.index("Fit:"):]
    line = next(ln for ln in fit.splitlines() if ln.split() and ln.split()[0] == "k3-4layer-dist-muon-8gpu")
    assert line.rstrip().endswith("n/a (ran on MI355X)")


def test_the_measured_layouts_carry_their_recipes_optimizer_settings():
    """Megatron-Bridge's performance configs: distributed optimizer with FSDP off (`optim`), BF16 gradient buffer
    (grad_reduce_in_fp32 = False), DeepSeek-V3's Adam moments in BF16, Kimi K2's dist_muon at tensor granularity."""
    for name in ("mb-12-deepseek-v3-gb300", "mb-13-deepseek-v3-gb200", "mb-14-deepseek-v3-b200",
                 "mb-22-deepseek-v3-gb200", "mb-17-qwen3-235b-a22b-gb300", "mb-18-qwen3-235b-a22b-gb200",
                 "mb-20-qwen3-30b-a3b-gb200", "mb-21-kimi-k2-gb300"):
        lay = k3opt.load_layout(name)
        assert (lay.dense_sharding.value, lay.expert_sharding.value, lay.grad_dtype.value) == \
            ("optim", "optim", "bf16"), name
        state = k3opt.load_model(lay.model).optimizer.state_of(lay.optimizer_state_dtype)
        assert state.value == ("bf16" if "deepseek" in name else "fp32"), name
    assert k3opt.load_layout("mb-21-kimi-k2-gb300").optimizer_shard_granularity.value == "tensor"


def test_nvls_off_drops_only_the_nvls_buffers():
    # NCCL_NVLS_ENABLE=0 (the Bridge performance runs' setting): NCCL sets up no NVLS buffers, so the device line
    # loses exactly the runtime's nccl_nvls item and nothing else moves (allocated and reserved are inside PyTorch).
    lay = k3opt.load_layout("mb-2-llama3-70b-gb200")
    on = k3opt.evaluate(lay, runtime="megatron-te-hybridep-gb200")
    off = k3opt.evaluate(lay)
    assert lay.runtime == "megatron-te-hybridep-gb200-nvls-off"
    a, b = on.ranks[0], off.ranks[0]
    assert a.allocated_bytes == b.allocated_bytes and a.reserved_bytes == b.reserved_bytes
    # With NVLS on, MB-2's 64 ranks in one 64-GPU domain join two NVLS-capable communicators of more than two ranks
    # (the dense shard group, 64, and the world, 64), each 32 channels x 2 x 128 KiB x 8 steps x 8 heads = 512 MiB
    # (the runtime file's figures): 1 GiB, all of the difference.
    assert a.device_bytes - b.device_bytes == 2 * 32 * 2 * 131_072 * 8 * 8 == 2**30
