"""Shipped presets with their optimizer set to Muon. DeepSeek-V3, Qwen3 and Llama 3 train with AdamW as their public
recipes do (constraints/models/*.toml [optimizer]); the tests of Muon's split, its ownership and its sharding on GQA,
MLA and DeepSeek-style MoE blocks keep their hand derivations on these variants."""

from __future__ import annotations

import k3opt


def under_muon(name: str) -> k3opt.ModelSpec:
    """The preset `name` with optimizer.name = "muon" (and its own name marked, so no cache confuses the two)."""
    data = k3opt.load_model(name).model_dump()
    data.update(name=f"{name}-muon", optimizer={"name": "muon"})
    return k3opt.ModelSpec.model_validate(data)
