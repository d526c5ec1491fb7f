"""The plan and front tables show the time a plan ranks by (k3opt.report.text.ranked_columns)."""

from __future__ import annotations

import math

import pandas as pd

from k3opt.report.text import ranked_columns


def test_the_tables_show_the_ranked_time_where_rates_exist_and_leave_the_frame_alone() -> None:
    """A row whose replayed schedule (11 s) is longer than its step formula (10 s) shows 11 s as its achievable
    time and 1,000 tokens/s / 10 GPUs = 100 per GPU, as its status line would; a row without rates keeps None; the
    frame passed in (the CSV's) keeps the formula."""
    df = pd.DataFrame({"gpus": [10, 10], "achievable_step_time_s": [10.0, None], "ranked_step_time_s": [11.0, 5.0],
                       "achievable_tokens_per_s_per_gpu": [110.0, None], "ranked_tokens_per_s": [1000.0, 2000.0]})
    shown = ranked_columns(df)
    assert shown["achievable_step_time_s"].iloc[0] == 11.0
    assert shown["achievable_tokens_per_s_per_gpu"].iloc[0] == 100.0
    assert math.isnan(shown["achievable_step_time_s"].iloc[1])
    assert math.isnan(shown["achievable_tokens_per_s_per_gpu"].iloc[1])
    assert df["achievable_step_time_s"].iloc[0] == 10.0
