"""Megatron's pipeline layout strings: read into a split (stages may hold no decoder layer), checked where k3opt
holds the edges, written back by the exports, and refused in one line when malformed. The strings are Megatron-LM's
own syntax (megatron/core/transformer/pipeline_parallel_layer_layout.py parse_str_to_list) and the layouts of the
public DeepSeek-V3 recipes (Megatron-Bridge recipes/deepseek/h100/deepseek_v3.py _get_deepseek_v3_pipeline_layout)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import explain_refusal

import k3opt
from k3opt.inputs import pipeline_layout as pll
from k3opt.inputs.errors import LayoutError
from k3opt.launch import to_launch

MB13 = Path(k3opt.__file__).parents[1] / "layouts" / "measured" / "mb-13-deepseek-v3-gb200.toml"


def _mb13(**update) -> k3opt.Layout:
    data = k3opt.load_layout(str(MB13)).model_dump()
    data.pop("split")
    data.pop("measured")
    data.update(update)
    return k3opt.make_layout(**data)


def test_the_deepseek_recipe_string_reads_as_its_split():
    # PP4 VP4: the embedding and 4 layers, 14 stages of 4, then 1 layer with the MTP layer and the loss = 61 layers.
    assert pll.decoder_split("Et*4|(t*4|)*14tmL") == [4] * 15 + [1]
    assert pll.mtp_layers("Et*4|(t*4|)*14tmL") == 1
    # Commas are cosmetic; a group repeats with its separators (Megatron's docstring example). So are spaces.
    assert pll.decoder_split("Ettt|(tt|)*2,tmL") == [3, 2, 2, 1]
    assert pll.decoder_split("Et*4 | (t*4|)*14 tmL") == [4] * 15 + [1]


def test_a_stage_may_hold_only_its_edge():
    lay = _mb13(pipeline_layout="E|t*5|(t*4|)*13t*4mL")
    assert lay.split == [0, 5] + [4] * 14
    ev = k3opt.evaluate(lay, k3opt.load_model("deepseek-v3"), k3opt.load_cluster("gb200-nvl72"))
    # Rank 0 holds chunks 0, 4, 8, 12: the embedding-only chunk adds no saved activations, so rank 0 holds 3 x 4
    # layers where MB-13's split gives it 4 x 4.
    base = k3opt.evaluate(k3opt.load_layout(str(MB13)), k3opt.load_model("deepseek-v3"),
                          k3opt.load_cluster("gb200-nvl72"))
    assert ev.ranks[0].ledger["activations"] < base.ranks[0].ledger["activations"]


def test_a_pp_rank_may_hold_the_embedding_alone():
    lay = _mb13(pp=2, vp=1, dense_fsdp=128, expert_fsdp=2, microbatches=32, pipeline_layout="E|t*61mL")
    assert lay.split == [0, 61]
    ev = k3opt.evaluate(lay, k3opt.load_model("deepseek-v3"), k3opt.load_cluster("gb200-nvl72"))
    # Rank 0 keeps only what the embedding saves: its int64 token ids, 4,096 x 8 B for each of the 2 microbatches
    # in flight on the first of two PP ranks (1F1B warm-up p - r = 2).
    assert ev.ranks[0].ledger["activations"] == 2 * 4096 * 8
    assert ev.ranks[1].ledger["activations"] > 0
    # DeepSeek-V3 has no AttnRes: no residual stream crosses the boundary, and the one PP packet is the hidden
    # stream, 4,096 tokens x 7,168 x 2 B, double-buffered on both ranks.
    stream = 4096 * 7168 * 2
    assert ev.ranks[0].ledger["attnres_bank"] == 0
    assert [r.ledger["pp_buffers"] for r in ev.ranks] == [2 * stream, 2 * stream]
    assert ev.ranks[0].counts["residual_streams_out"] == [0]


def test_the_export_writes_the_string_back_with_the_mtp_layers():
    model = k3opt.load_model("deepseek-v3")
    given = _mb13(pipeline_layout="Et*4|(t*4|)*14tmL")
    assert "--pipeline-model-parallel-layout 'Et*4|(t*4|)*14tmL'" in to_launch(given, "megatron-lm", model).text
    # Without a string the export writes the split, with DeepSeek-V3's one MTP layer before the loss.
    text = to_launch(k3opt.load_layout(str(MB13)), "megatron-lm", model).text
    value = re.search(r"--pipeline-model-parallel-layout '([^']+)'", text).group(1)
    assert value.endswith("|tmL") and pll.decoder_split(value) == [4] * 15 + [1]
    assert pll.format_layout([0, 61], 1) == "E|t*61mL"
    assert pll.format_layout([3, 0, 2], 0) == "Et*3||t*2L"


def test_explain_prints_the_layout_string(tmp_path: Path):
    from k3opt.inputs.presets import layout_toml

    saved = tmp_path / "lay.toml"
    saved.write_text(layout_toml(_mb13(pipeline_layout="E|t*5|(t*4|)*13t*4mL")))
    res = subprocess.run([sys.executable, "-m", "k3opt.cli", "explain", str(saved)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "split 0+5+4x14 (Megatron layout E|t*5|(t*4|)*13t*4mL)" in res.stdout


@pytest.mark.parametrize(("text", "words"), [
    ("Et*4|(t*4|)*14txL", "unknown symbol 'x'; use E (embedding), t (decoder layer), m (MTP layer), L (loss)"),
    ("Et*4|(t*4|)*14tXL", "unknown symbol 'X'"),
    ("t*4|E(t*4|)*14tmL", "'E' must open the first stage"),
    ("Et*4|(t*4|)*14tLm", "'L' must close the last stage"),
    ("Et*4|(t*4|)*13t*3m|t*2L", "MTP layers 'm' go in the last stage"),
    ("Et*4|(t*4|)*14mtL", "MTP layers 'm' go in the last stage after its decoder layers (k3opt holds them with "
                          "the loss)"),
    ("Et*4|(t*4|)*14tmtmL", "MTP layers 'm' go in the last stage"),
])
def test_a_malformed_string_is_one_line(text: str, words: str):
    with pytest.raises(LayoutError, match=re.escape(words)):
        _mb13(pipeline_layout=text)


def test_a_string_that_disagrees_with_the_split_or_the_model_is_refused():
    with pytest.raises(LayoutError, match="give one of them"):
        _mb13(pipeline_layout="Et*4|(t*4|)*14tmL", split=[5] + [4] * 14 + [0])
    with pytest.raises(LayoutError, match="places 0 MTP layers"):
        k3opt.evaluate(_mb13(pipeline_layout="Et*4|(t*4|)*14tL"), k3opt.load_model("deepseek-v3"),
                       k3opt.load_cluster("gb200-nvl72"))


def test_explain_refuses_a_bad_string_with_exit_2(tmp_path: Path):
    text = MB13.read_text().replace("split = [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 1]",
                                    'pipeline_layout = "Et*4|(t*4|)*14tLm"')
    assert "'L' must close the last stage" in explain_refusal(tmp_path, text)
