"""Megatron's pipeline layout string (`--pipeline-model-parallel-layout`), read and written in one place.

A string lists the pp x vp stages separated by '|', stage i on PP rank i % pp and virtual stage i // pp (the
order of k3opt's chunks): 'E' the embedding, 't' a decoder layer, 'm' an MTP layer, 'L' the output layer and loss;
'x*n' repeats a symbol, '(...)*n' a group, commas are cosmetic. Example: "Et*4|(t*4|)*14tmL" (DeepSeek-V3 on
PP4 VP4). Megatron-LM's parser and rules: megatron/core/transformer/pipeline_parallel_layer_layout.py
(parse_str_to_list L283-320, validate_layer_layout L86-150) @ d98e8a64.

k3opt holds the embedding on the first chunk and the output layer, loss and MTP layers on the last (the model's
`first` and `last` edges), so a string must place them there; stages may hold no decoder layer.
"""

from __future__ import annotations

import re

_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_REPEAT = re.compile(r"(.)\*(\d+)")


def parse(text: str) -> list[str]:
    """The stages of a layout string, unrolled ('E' + 't' * 4, ...), as Megatron's parse_str_to_list reads it."""
    s = text.replace(",", "").replace(" ", "")
    for pattern in (_GROUP, _REPEAT):
        s = pattern.sub(lambda m: m.group(1) * int(m.group(2)), s)
    stages = s.split("|")
    bad = sorted({c for c in s if c not in "EtmL|"})
    if bad:
        raise ValueError(f"pipeline_layout {text!r}: unknown symbol {bad[0]!r}; use E (embedding), t (decoder "
                         "layer), m (MTP layer), L (loss), '|' between stages, x*n and (...)*n to repeat")
    return stages


def decoder_split(text: str) -> list[int]:
    """Decoder layers per stage of a layout string, after checking that the embedding opens the first stage, the
    loss closes the last, and MTP layers sit in the last stage after its decoder layers (where k3opt holds them)."""
    stages = parse(text)
    flat = "".join(stages)
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        raise ValueError(f"pipeline_layout {text!r}: the embedding 'E' must open the first stage, once")
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        raise ValueError(f"pipeline_layout {text!r}: the loss 'L' must close the last stage, once")
    last = stages[-1]
    if "m" in "".join(stages[:-1]) or ("m" in last and "t" in last[last.index("m"):]):
        raise ValueError(f"pipeline_layout {text!r}: MTP layers 'm' go in the last stage after its decoder layers "
                         "(k3opt holds them with the loss)")
    return [st.count("t") for st in stages]


def mtp_layers(text: str) -> int:
    """MTP layers a layout string places."""
    return "".join(parse(text)).count("m")


def format_layout(split: list[int] | tuple[int, ...], mtp: int) -> str:
    """The layout string of a split: 'E' opening the first stage, 't*n' for n decoder layers, the `mtp` MTP layers
    and 'L' closing the last stage; a stage without decoder layers holds only its edge (or nothing)."""
    last = len(split) - 1
    stages = []
    for j, n in enumerate(split):
        body = f"t*{n}" if n > 1 else "t" * n
        stages.append(("E" if j == 0 else "") + body + ("m" * mtp + "L" if j == last else ""))
    return "|".join(stages)
