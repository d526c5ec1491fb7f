"""The CLI's live view (report/live.py): rich on a terminal, plain periodic lines elsewhere, nothing when off."""

from __future__ import annotations

import io
import re
import time

from k3opt.report.live import LiveProgress, SweepLive
from k3opt.search.progress import Progress
from k3opt.sweep.run import SweepStatus

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


def test_sweep_progress_counts_done_failed_running_and_eta():
    out = io.StringIO()
    st = SweepStatus(total=10, done=3, failed=1, running=2, skipped=1, started=time.monotonic() - 20.0)
    with SweepLive(True, stream=out, period_s=0.0, terminal=False) as live:
        live(st)
    line = out.getvalue().strip()
    # 2 points planned in this run in 20 s: 10 s each, 7 left -> 70 s
    assert line.startswith("3/10 points done (1 from the file), 1 failed, 2 running, ETA 7")
    assert 69 <= float(re.search(r"ETA ([\d.]+) s", line).group(1)) <= 72
    tty = io.StringIO()
    with SweepLive(True, stream=tty, terminal=True) as live:
        live(st)
    assert "3/10 points done" in tty.getvalue()
    quiet = io.StringIO()
    with SweepLive(False, stream=quiet, terminal=False) as live:
        live(st)
    assert quiet.getvalue() == ""
