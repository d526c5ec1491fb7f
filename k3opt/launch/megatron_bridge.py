"""Megatron-Bridge recipe overrides for a layout (github.com/NVIDIA-NeMo/Megatron-Bridge @ 067f987d).

Bridge takes Hydra/OmegaConf `group.key=value` overrides after `scripts/training/run_recipe.py --recipe ...`
(docs/megatron-lm-to-megatron-bridge.md). Its model providers subclass Megatron core's TransformerConfig, so
each Megatron-LM decision maps to a `model.*`, `ddp.*`, `optimizer.*`, `mixed_precision.*`, `train.*` or
`dataset.*` key (scripts/translate_mlm_to_bridge.py); Kimi K3 adds `model.kimi_kda_layers` (1-indexed).
"""

from __future__ import annotations

import shlex

from k3opt.inputs.presets import shipped_model
from k3opt.inputs.specs import Layout, ModelSpec, kda_layers
from k3opt.launch.common import Launch
from k3opt.launch.megatron_lm import megatron_settings


def _value(v: object) -> str:
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, list):
        return "[" + ",".join(str(x) for x in v) + "]"
    if isinstance(v, str) and any(c in v for c in "|*[]()+,"):
        return f'"{v}"'  # OmegaConf parses an unquoted [..] or a|b as grammar; quote to keep a string
    return str(v)


RECIPES: dict[str, tuple[str, str]] = {
    "llama3-70b": ("llama3_70b_pretrain_config", "src/megatron/bridge/recipes/llama/__init__.py L32"),
    "deepseek-v3": ("deepseek_v3_pretrain_config", "src/megatron/bridge/recipes/deepseek/__init__.py L29"),
    "qwen3-30b-a3b": ("qwen3_30b_a3b_pretrain_config", "src/megatron/bridge/recipes/qwen/__init__.py L86"),
    "qwen3-235b-a22b": ("qwen3_235b_a22b_pretrain_config", "src/megatron/bridge/recipes/qwen/__init__.py L89"),
    "kimi-k2": ("kimi_k2_pretrain_config", "src/megatron/bridge/recipes/kimi/__init__.py L15"),
}
"""The library pretraining recipe Bridge ships (at the pinned commit) for each of k3opt's model presets, with its
source; Kimi K3 has none. Keyed by the preset a model is field for field (`shipped_model`): a model file that
reuses a preset's name with other shapes gets no recipe."""


def export(layout: Layout, model: ModelSpec) -> Launch:
    """`key=value` overrides, one per line, with the missing switches as comments."""
    settings, miss, notes = megatron_settings(layout, model, bridge=True)
    preset = shipped_model(model)
    recipe = RECIPES.get(preset) if preset is not None else None
    if recipe is None:
        k3 = bool(kda_layers(model))  # a KDA model is built on Bridge's Kimi K3 provider, whatever its name
        notes = list(notes) + [f"no {'Kimi K3' if k3 else model.name} training recipe ships at this commit: pass these "
                               "overrides to scripts/training/run_recipe.py with a recipe built on "
                               f"{'KimiK3ModelProvider' if k3 else 'its model provider'}"]
        name = f"<your_{model.name.replace('-', '_')}_recipe>"
    else:
        notes = list(notes) + [f"the overrides apply to Bridge's {recipe[0]} ({recipe[1]}); its other settings "
                               "(optimizer schedule, data, precision defaults) are the recipe's"]
        name = recipe[0]
    lines = [f"python scripts/training/run_recipe.py --recipe {name} \\"]
    pairs = []
    for st in settings:
        if st.key is None:
            continue
        val = _value(st.value if st.bridge_value is None else st.bridge_value)
        lines.append("    " + shlex.quote(f"{st.key}={val}") + " \\")
        pairs.append((st.key, val))
    lines[-1] = lines[-1].removesuffix(" \\")
    return Launch("megatron-bridge", layout, "\n".join(lines), tuple(pairs), tuple(miss), tuple(notes))
