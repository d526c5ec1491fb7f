"""The lab end to end in a real headless browser: Playwright driving Debian's chromium (its executable path: the
browser cannot be downloaded here). The page loads on the reference run with `k3opt explain`'s ledger, a PP change
redraws the ledger, bad input shows its line beside its control, a short plan runs with its live state, and a
front point loads into the explorer. Screenshots go to $K3OPT_ARTIFACTS (default: test-artifacts/)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
sync_api = pytest.importorskip("playwright.sync_api")
from click.testing import CliRunner  # noqa: E402

from k3opt.cli import main  # noqa: E402
from k3opt.serve import create_app  # noqa: E402

CHROMIUM = os.environ.get("K3OPT_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("K3OPT_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason=f"no chromium at {CHROMIUM} (.ci/run installs Debian's chromium)")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    end = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < end, "the lab did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    t.join(10)


@pytest.fixture(scope="module")
def page(server: str) -> Iterator[sync_api.Page]:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        pg = browser.new_page(viewport={"width": 1500, "height": 1200})
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(server)
        pg.wait_for_selector("body[data-ready='1']", timeout=60_000)
        yield pg
        browser.close()
        assert not errors, errors


def _cell(pg: sync_api.Page, term: str, rank: int) -> str:
    return pg.locator("#ledger-table tbody tr").filter(
        has=pg.locator("td:first-child", has_text=re.compile(f"^{re.escape(term)}$"))).locator("td").nth(
        rank + 1).inner_text()


def _evaluated(pg: sync_api.Page, change) -> None:  # noqa: ANN001 - a callable that edits the page
    before = pg.evaluate("document.body.dataset.evaluated")
    change()
    pg.wait_for_function(f"document.body.dataset.evaluated && document.body.dataset.evaluated !== '{before}' "
                         "&& !window.k3lab.pending", timeout=30_000)


def test_1_the_page_opens_on_the_reference_ledger_explain_prints(page: sync_api.Page) -> None:
    text = CliRunner().invoke(main, ["explain", "k3-gb200-512-reference"]).output
    # explain's rows: `master  19.48 21.08 ...` per rank; the page's table carries the same text.
    for term in ("master", "bf16_view", "PEAK", "DEVICE", "headroom"):
        line = next(ln for ln in text.splitlines() if ln.startswith(term + " "))
        printed = line[len(term):].split()
        assert [_cell(page, term, r) for r in range(8)] == printed, term
    assert page.locator("[data-k=layout]").inner_text().startswith("PP8 VP1")
    assert page.locator("#ledger-chart .bars .point").count() > 0  # the stacked bars are drawn
    page.screenshot(path=str(ARTIFACTS / "lab-reference.png"), full_page=True)


def test_2_a_pp_change_redraws_the_ledger(page: sync_api.Page) -> None:
    master_before = _cell(page, "master", 0)
    _evaluated(page, lambda: page.fill("input[name=pp]", "4"))
    assert page.locator("[data-k=layout]").inner_text().startswith("PP4 VP1")
    assert page.locator("[data-k=split]").inner_text() == "24+23x3"
    # Half the stages: rank 0 holds 24 of 93 layers instead of 12, so its FP32 master shard about doubles.
    assert float(_cell(page, "master", 0)) > 1.8 * float(master_before)
    assert page.locator("#ledger-table thead th").count() == 1 + 4
    # One segment (start, end, gap) per forward and per backward: 2 x PP x VP x M = 2 x 4 x 1 x 64 operations, drawn
    # on the chart's WebGL canvas.
    segments = page.evaluate("document.getElementById('timeline-chart').data.map((t) => t.x.length / 3)")
    assert segments == [256, 256]
    assert page.locator("#timeline-chart canvas.gl-canvas-context").count() == 1


def test_3_bad_input_shows_its_line_beside_its_control(page: sync_api.Page) -> None:
    _evaluated(page, lambda: page.fill("input[name=ep]", "7"))
    beside = page.locator(".err[data-for=ep]")
    assert "ep (7) must divide" in beside.inner_text()
    assert "bad" in page.locator("input[name=ep]").get_attribute("class")
    _evaluated(page, lambda: page.fill("input[name=pp]", "seven"))
    assert "not a number" in page.locator(".err[data-for=pp]").inner_text()
    page.screenshot(path=str(ARTIFACTS / "lab-bad-input.png"), full_page=True)
    _evaluated(page, lambda: (page.fill("input[name=ep]", "64"), page.fill("input[name=pp]", "8")))
    assert page.locator(".err[data-for=pp]").inner_text() == ""
    assert page.locator("[data-k=layout]").inner_text().startswith("PP8 VP1")


def test_4_a_short_plan_shows_its_state_and_a_front_point_loads_into_the_explorer(page: sync_api.Page) -> None:
    # A small job (Qwen3-30B-A3B on 8 B200 GPUs) so the front has points within a few seconds.
    page.select_option("select[name=model]", "qwen3-30b-a3b")
    page.select_option("select[name=cluster]", "b200")
    page.fill("input[name=gpus]", "8")
    page.click("button[data-tab=plan]")
    page.fill("input[name=tokens_per_update]", "1048576")
    page.fill("input[name=time_limit]", "8")
    page.click("#run-plan")
    page.wait_for_function("document.querySelector('#plan-live').dataset.state === 'done'", timeout=60_000)
    live = page.locator("#plan-live").inner_text()
    assert live.startswith("OPTIMAL: best") and "bound" in live and "gap" in page.locator("#plan-live").inner_text()
    assert page.locator("#plan-table tbody tr").count() >= 1
    assert page.locator("#plan-downloads a").get_attribute("href").endswith("/csv")

    page.click("#run-pareto")
    page.wait_for_function("document.querySelector('#plan-live').dataset.state === 'running'", timeout=10_000)
    seen = page.locator("#plan-live").inner_text()
    page.wait_for_function("document.querySelector('#plan-live').dataset.state === 'done'", timeout=60_000)
    assert seen.startswith("running")
    assert page.locator("#front-chart .scatterlayer .point").count() >= 2
    page.screenshot(path=str(ARTIFACTS / "lab-front.png"), full_page=True)
    first = page.locator("#plan-table tbody tr").first.locator("td").nth(1).inner_text()
    _evaluated(page, lambda: page.locator("#front-chart .scatterlayer .point").first.click(force=True))
    assert page.locator("#explore").is_visible()
    shown = page.locator("[data-k=layout]").inner_text()
    assert shown == first and page.locator("input[name=gpus]").input_value() == "8"
    assert page.locator("#form-error").inner_text() == ""
    page.screenshot(path=str(ARTIFACTS / "lab-front-point-loaded.png"), full_page=True)
