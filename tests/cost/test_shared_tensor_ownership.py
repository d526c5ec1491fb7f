"""Whole-tensor ownership on a model with a shared tensor (DeepSeek-V3's MTP head is the LM head: count 0)."""

from __future__ import annotations

import k3opt
from k3opt.inputs.presets import load_layout


def test_tensor_granularity_on_deepseek_v3_with_its_shared_mtp_head() -> None:
    """The MTP module's `shared_head` owns no parameters (count 0); dealing whole tensors skips it instead of
    dividing by its count. The worst owner of whole tensors holds at least the even element share."""
    lay = load_layout("mb-13-deepseek-v3-gb200").model_copy(update={"measured": None})
    whole = k3opt.evaluate(lay.model_copy(update={"optimizer_shard_granularity": "tensor"}))
    even = k3opt.evaluate(lay)
    assert whole.peak_bytes >= even.peak_bytes
