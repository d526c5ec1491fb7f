"""The cross-entropy kernels' HBM bytes per logit are derived from dtypes in the cost model
(coefficients.TE_CROSS_ENTROPY_BYTES_PER_LOGIT); the rates file only switches them on (`[loss_kernels]`). A rates
file with the retired hand-summed `loss_bytes_per_logit` still loads when it names the figure the model derives,
and is one clear error otherwise."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from click.testing import CliRunner

import k3opt
import k3opt.inputs.rates
from k3opt.cli import main
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.inputs.errors import SpecError
from k3opt.inputs.rates import TE_CROSS_ENTROPY_BYTES_PER_LOGIT, load_rates

SHIPPED = k3opt.inputs.presets.preset_dir("rates")


def _old_style(value: str) -> str:
    """The b200 rates file as it was before the switch: a `[loss_bytes_per_logit]` table instead."""
    text = (SHIPPED / "b200.toml").read_text()
    start = text.index("[loss_kernels]")
    end = text.index("\n[", start + 1)
    return text[:start] + (f'[loss_bytes_per_logit]\nvalue = {value}\nunit = "HBM bytes per logit"\n'
                           'kind = "derived"\nsource = "TransformerEngine cross_entropy.py"\n') + text[end:]


def _layout() -> k3opt.Layout:
    return k3opt.make_layout(gpus=8, pp=1, ep=8, dense_fsdp=8, expert_fsdp=1, microbatches=4, context=4096,
                             split=[48], recompute="none", precision="bf16")


def _vector(rates) -> np.ndarray:
    cf = coefficients(Shape.of(_layout()), k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("b200"),
                      rates=rates)
    return cf.achievable["vector"]


def test_te_cross_entropy_moves_22_bytes_per_logit():
    """TransformerEngine's fused cross entropy (transformer_engine/common/triton/cross_entropy.py): online_softmax
    reads the BF16 logits (2 B); cross_entropy_kernel reads them again and writes the FP32 gradient (2 + 4 B); the
    backward element_mul scales it in place (4 + 4 B); autograd casts it to BF16 (4 + 2 B): 22 B."""
    assert TE_CROSS_ENTROPY_BYTES_PER_LOGIT == 22


def test_the_switch_off_leaves_the_loss_kernels_unpriced():
    """Off, or absent, the last edge's vector time drops by 4,096 x 151,936 x 22 B at 8 TB/s x 0.74 (Qwen3-30B-A3B,
    one output head); nothing else moves."""
    on = load_rates("b200")
    off = on.model_copy(update={"loss_kernels": on.loss_kernels.model_copy(update={"te_fused_cross_entropy": False})})
    v_on, v_off, v_absent = _vector(on), _vector(off), _vector(on.model_copy(update={"loss_kernels": None}))
    assert v_on[-1] - v_off[-1] == pytest.approx(4096 * 151_936 * 22 / (8000e9 * 0.74), rel=1e-12)
    assert list(v_off) == list(v_absent)
    assert list(v_on[:-1]) == list(v_off[:-1])


def test_a_rates_file_with_the_retired_field_at_the_derived_figure_still_loads(tmp_path):
    """`loss_bytes_per_logit = 22.0` is what the model derives: it loads as the switch on, with a FutureWarning
    that names the replacement, and prices exactly what the shipped file does."""
    path = tmp_path / "old.toml"
    path.write_text(_old_style("22.0"))
    with pytest.warns(FutureWarning, match=r"loss_bytes_per_logit is deprecated.*\[loss_kernels\]"):
        old = load_rates(str(path))
    assert old.loss_kernels is not None and old.loss_kernels.te_fused_cross_entropy
    assert list(_vector(old)) == list(_vector(load_rates("b200")))


@pytest.mark.parametrize(("body", "match"), [
    ("30.0", r"loss_bytes_per_logit = 30\.0 is no longer read.*22 B per logit.*\[loss_kernels\]"),
    ('"22"', r"loss_bytes_per_logit = '22' is no longer read"),
])
def test_a_retired_field_the_model_cannot_price_is_one_clear_error(tmp_path, body, match):
    path = tmp_path / "old.toml"
    path.write_text(_old_style(body))
    with pytest.raises(SpecError, match=match) as err:
        load_rates(str(path))
    assert "\n" not in str(err.value)


def test_the_retired_field_beside_the_switch_is_an_error(tmp_path):
    path = tmp_path / "both.toml"
    text = _old_style("22.0")
    path.write_text(text + '\n[loss_kernels]\nte_fused_cross_entropy = true\nsource = "TE"\n')
    with pytest.raises(SpecError, match=r"loss_bytes_per_logit is retired and \[loss_kernels\] is given too"):
        load_rates(str(path))


def test_cli_with_a_retired_loss_field_exits_2_with_one_line(tmp_path, monkeypatch):
    """A user's rates preset folder holding an old b200 file with another byte count: `explain` of a B200 layout
    prints one line naming the field and its replacement, exit status 2, no traceback."""
    for f in SHIPPED.glob("*.toml"):
        (tmp_path / f.name).write_text(f.read_text())
    (tmp_path / "b200.toml").write_text(_old_style("30.0"))
    real = k3opt.inputs.rates.preset_dir
    monkeypatch.setattr(k3opt.inputs.rates, "preset_dir", lambda kind: tmp_path if kind == "rates" else real(kind))
    k3opt.inputs.rates._shipped_rates.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            result = CliRunner().invoke(main, ["explain", "mb-14-deepseek-v3-b200"])
    finally:
        k3opt.inputs.rates._shipped_rates.cache_clear()
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "loss_bytes_per_logit = 30.0 is no longer read" in lines[0], result.output
