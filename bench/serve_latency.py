"""The lab's redraw latency: a control change on K3 at 512 GPUs, re-evaluated and drawn.

    python bench/serve_latency.py [--repeat 20]

Two measurements per layout: the API alone (POST /api/evaluate in-process, evaluate() plus the page's JSON) and
end to end in headless chromium (Playwright drives the change; the page's own clock times it from the input event
to the end of the redraw of the summary, the ledger bars, the time chart, the timeline and the ledger table, the
30-ms debounce included). The layouts are the reference run, the same at PP4 and PP16, and the best plan of the
default job (PP8 VP4, 32 chunks). Prints one markdown row per layout with the machine, the median and the 90th
percentile."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import threading
import time

import uvicorn
from fastapi.testclient import TestClient

from k3opt.serve import create_app

CASES = {
    "reference PP8 VP1 M64": {},
    "PP4 VP1 M64": {"pp": "4", "split": ""},
    "PP16 VP1 EP32 M64": {"pp": "16", "split": "", "ep": "32", "dense_fsdp": "32"},
    "PP8 VP4 M64 (the default job's best)": {"vp": "4", "split": "3x28+2+3+2x2", "recompute": "selective"},
}


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def api_times(repeat: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    with TestClient(create_app()) as c:
        base = c.get("/api/options").json()["default"]
        for name, change in CASES.items():
            form = {**base, **change}
            c.post("/api/evaluate", json=form).raise_for_status()  # warm the coefficient caches
            ts = []
            for _ in range(repeat):
                t = time.perf_counter()
                c.post("/api/evaluate", json=form).raise_for_status()
                ts.append(time.perf_counter() - t)
            out[name] = ts
    return out


def browser_times(repeat: int) -> dict[str, list[float]]:
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("K3OPT_CHROMIUM") or shutil.which("chromium")
    if not chromium:
        return {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    out: dict[str, list[float]] = {}
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        pg = b.new_page(viewport={"width": 1500, "height": 1200})
        pg.goto(f"http://127.0.0.1:{port}/")
        pg.wait_for_selector("body[data-ready='1']", timeout=60_000)
        for name, change in CASES.items():
            ts = []
            before = pg.evaluate("document.body.dataset.evaluated")
            for k, v in change.items():
                pg.fill(f"[name={k}]", v) if k != "recompute" else pg.select_option("[name=recompute]", v)
            if change:
                pg.wait_for_function(f"document.body.dataset.evaluated !== '{before}' && !window.k3lab.pending")
            for i in range(repeat):
                # Alternate the reserve so every round is a real change of this layout.
                before = pg.evaluate("document.body.dataset.evaluated")
                pg.fill("[name=reserve_gib]", str((i + 1) % 2))
                pg.wait_for_function(f"document.body.dataset.evaluated !== '{before}' && !window.k3lab.pending")
                # The page's own clock: from the input event to the end of the redraw (serve/static/app.js),
                # without Playwright's round trips.
                ts.append(float(pg.evaluate("document.body.dataset.latencyMs")) / 1e3)
            out[name] = ts
            pg.reload()
            pg.wait_for_selector("body[data-ready='1']", timeout=60_000)
        b.close()
    srv.should_exit = True
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"
    api, web = api_times(args.repeat), browser_times(args.repeat)
    print(f"machine: {machine}")
    print("| layout | API median ms | API p90 ms | page median ms | page p90 ms |")
    print("|---|---:|---:|---:|---:|")
    for name in CASES:
        a, w = api[name], web.get(name, [])
        page = f"{1e3 * statistics.median(w):.0f} | {1e3 * _pct(w, 0.9):.0f}" if w else "- | -"
        print(f"| {name} | {1e3 * statistics.median(a):.0f} | {1e3 * _pct(a, 0.9):.0f} | {page} |")


if __name__ == "__main__":
    main()
