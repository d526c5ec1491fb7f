"""The plan prints a GAP line for a row whose replayed pipeline schedule exceeds its step formula."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import k3opt
from k3opt.inputs.specs import Layout
from k3opt.report.text import schedule_gap_lines

BASE = dict(gpus=512, pp=8, vp=2, cp=1, ep=64, expert_fsdp=1, dense_fsdp=64, microbatches=64, rows=1, context=4096,
            recompute="full", domain_gpus_used=64)


def test_uneven_chunks_with_equal_ranks_are_flagged() -> None:
    # Both splits give rank r chunks r and r + 8 with 12 layers together (rank 7: 9), so the step formula,
    # (M + (p - 1) / v) x the slowest rank, is the same; the uneven one starts every microbatch through eight
    # 1-layer chunks and ends it through 11-layer ones, so its replay is longer.
    even = k3opt.evaluate(Layout(split=[6] * 15 + [3], **BASE))
    uneven = k3opt.evaluate(Layout(split=[1] * 8 + [11] * 7 + [8], **BASE))
    for st in (even.step, uneven.step):
        assert st.ranked_schedule_time_s == st.achievable_schedule_step_time_s  # the rates file's replay
    assert uneven.step.formula_time_s == pytest.approx(even.step.formula_time_s, rel=1e-12)
    assert uneven.step.step_time_s == pytest.approx(even.step.step_time_s, rel=1e-12)
    assert uneven.step.ranked_schedule_time_s > 1.2 * uneven.step.formula_time_s
    assert uneven.step.schedule_step_time_s > 1.2 * uneven.step.step_time_s  # at peak rates too
    # The uneven split ranks by its replay; the even one by the formula (its replay is within it).
    assert uneven.step.rank_time_s == uneven.step.ranked_schedule_time_s
    assert even.step.rank_time_s == even.step.formula_time_s >= even.step.ranked_schedule_time_s
    # Equal chunks: the textbook bubble, so the replay stays within the 2% threshold of the formula.
    assert schedule_gap_lines([SimpleNamespace(evaluation=even)]) == []
    lines = schedule_gap_lines([SimpleNamespace(evaluation=even), SimpleNamespace(evaluation=uneven)])
    assert len(lines) == 2 and lines[1].startswith("row 2 is ranked by its replayed pipeline schedule, ")
    assert f"{uneven.step.ranked_schedule_time_s:.2f} s" in lines[1]
    assert f"{uneven.step.formula_time_s:.2f} s" in lines[1]
