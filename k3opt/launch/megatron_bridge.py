"""Megatron-Bridge recipe overrides for a layout (github.com/NVIDIA-NeMo/Megatron-Bridge @ 067f987d).

Bridge takes Hydra/OmegaConf `group.key=value` overrides after `scripts/training/run_recipe.py --recipe ...`
(docs/megatron-lm-to-megatron-bridge.md). Its model providers subclass Megatron core's TransformerConfig, so
each Megatron-LM decision maps to a `model.*`, `ddp.*`, `optimizer.*`, `mixed_precision.*`, `train.*` or
`dataset.*` key (scripts/translate_mlm_to_bridge.py); Kimi K3 adds `model.kimi_kda_layers` (1-indexed).
"""

from __future__ import annotations

import shlex

from k3opt.inputs.specs import Layout, ModelSpec
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


def export(layout: Layout, model: ModelSpec) -> Launch:
    """`key=value` overrides, one per line, with the missing switches as comments."""
    settings, miss, notes = megatron_settings(layout, model, bridge=True)
    notes = list(notes) + ["no Kimi K3 training recipe ships at this commit: pass these overrides to "
                           "scripts/training/run_recipe.py with a recipe built on KimiK3ModelProvider"]
    lines = ["python scripts/training/run_recipe.py --recipe <your_kimi_k3_recipe> \\"]
    pairs = []
    for st in settings:
        if st.key is None:
            continue
        val = _value(st.value if st.bridge_value is None else st.bridge_value)
        lines.append("    " + shlex.quote(f"{st.key}={val}") + " \\")
        pairs.append((st.key, val))
    lines[-1] = lines[-1].removesuffix(" \\")
    return Launch("megatron-bridge", layout, "\n".join(lines), tuple(pairs), tuple(miss), tuple(notes))
