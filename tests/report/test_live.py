"""The CLI's live view (report/live.py): rich on a terminal, plain periodic lines elsewhere, nothing when off."""

from __future__ import annotations

import io
import re
import time

from k3opt.report.live import LiveProgress
from k3opt.search.progress import Progress

SNAP = Progress("solving", 7.0, incumbent_s=18.631, bound_s=18.474, shapes_settled=1234, shapes_total=9330,
                models_solved=5)


def test_plain_lines_move_their_own_clock():
    out = io.StringIO()
    with LiveProgress(True, stream=out, period_s=0.05, terminal=False) as live:
        live(SNAP)
        time.sleep(0.4)
    lines = out.getvalue().splitlines()
    assert lines, "no periodic line"
    assert all("best 18.631 s, bound 18.474 s, gap 0.84%, shapes settled 1234/9330" in ln for ln in lines)
    # The snapshot said 7.0 s; the lines count on from it while no new snapshot comes (a long CP-SAT slice).
    elapsed = [float(re.match(r"\[\s*([\d.]+) s\]", ln).group(1)) for ln in lines]
    assert elapsed[-1] > 7.0 and elapsed == sorted(elapsed)


def test_terminal_view_shows_incumbent_bound_gap_and_shapes():
    out = io.StringIO()
    with LiveProgress(True, "plan", stream=out, terminal=True, refresh_per_second=20) as live:
        live(SNAP)
        time.sleep(0.3)
    text = out.getvalue()
    for want in ("18.631 s", "18.474 s", "0.84%", "1,234 / 9,330", "solving"):
        assert want in text, want


def test_disabled_view_prints_nothing_and_gives_no_callback():
    out = io.StringIO()
    with LiveProgress(False, stream=out, period_s=0.01, terminal=False) as live:
        assert live.callback is None
        time.sleep(0.05)
    assert out.getvalue() == ""
