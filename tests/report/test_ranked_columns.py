"""The plan and front tables show the time a plan ranks by (k3opt.report.text.ranked_columns)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from k3opt.report.text import ranked_columns


def test_the_tables_show_the_ranked_time_where_rates_exist_and_leave_the_frame_alone() -> None:
    """A row whose replayed schedule (11 s) is longer than its step formula (10 s) shows 11 s as its achievable
    time and 1,000 tokens/s / 10 GPUs = 100 per GPU, as its status line would; a row without rates keeps None; the
    frame passed in (the CSV's) keeps the formula."""
    df = pd.DataFrame({"gpus": [10, 10], "achievable_step_time_s": [10.0, None], "ranked_step_time_s": [11.0, 5.0],
                       "achievable_tokens_per_s_per_gpu": [110.0, None], "ranked_tokens_per_s": [1000.0, 2000.0],
                       "ranked_tokens_per_s_per_gpu": [100.0, 200.0]})
    shown = ranked_columns(df)
    assert shown["achievable_step_time_s"].iloc[0] == 11.0
    assert shown["achievable_tokens_per_s_per_gpu"].iloc[0] == 100.0
    assert math.isnan(shown["achievable_step_time_s"].iloc[1])
    assert math.isnan(shown["achievable_tokens_per_s_per_gpu"].iloc[1])
    assert df["achievable_step_time_s"].iloc[0] == 10.0


def test_explain_names_the_ranked_step_where_the_replay_is_longer() -> None:
    """Tiny MoE, PP2 VP2, M2, split 4 0 0 2: rank 0 holds all four of its layers in its first chunk, so its second
    chunk's slot is idle while rank 1 waits on it, and the replayed schedule runs past the step formula (37% here).
    explain then prints the time plans rank it by, the replay (as the plan's status line and table do); a v = 1
    split (3 3 at M8, which the formula never under-prices) prints no such line."""
    from pathlib import Path

    import k3opt
    from k3opt.cost.evaluate import evaluate
    from k3opt.inputs.presets import make_layout
    from k3opt.report.text import explain_text

    data = Path(__file__).parents[1] / "data"
    tiny, slow = k3opt.load_model(data / "tiny-moe.toml"), k3opt.load_cluster(data / "slow-cluster.toml")

    def lay(split: list[int], m: int) -> k3opt.Layout:
        return make_layout(gpus=8, pp=2, vp=len(split) // 2, ep=2, expert_fsdp=1, dense_fsdp=2, microbatches=m,
                           context=2048, split=split, recompute="full", fsdp_lifecycle="per_microbatch", toggles={},
                           reserve_gib=0.0, dense_sharding="optim_grads_params", expert_sharding="optim_grads_params")

    uneven = evaluate(lay([4, 0, 0, 2], 2), tiny, slow)
    assert uneven.step.ranked_schedule_time_s > 1.3 * uneven.step.formula_time_s
    assert f"ranked step {uneven.step.rank_time_s:.3f} s (what plans rank this layout by)" in explain_text(uneven)
    even = evaluate(lay([3, 3], 8), tiny, slow)
    assert even.step.ranked_schedule_time_s <= 1.02 * even.step.formula_time_s
    assert "ranked step" not in explain_text(even)
    # The ranked tokens/s per GPU the tables show: the update's tokens over the ranked step, over the 8 GPUs.
    st = uneven.step
    assert st.rank_tokens_per_s_per_gpu == pytest.approx(st.tokens_per_update / st.rank_time_s / 8)
