"""Regenerate the pictures and launch exports in docs/ from the default plan.

    python docs/make_pictures.py [--time-limit 300]
    python docs/make_pictures.py --layout FILE     # exports only, from a layout saved by `k3opt plan --save 1`

Runs one search of the built-in k3-512-4k job with its Pareto front (about 5 minutes on 2 cores), then writes
docs/ledger.png, docs/timeline.png and docs/pareto.png for the best layout and the front, and
docs/launch/default-plan.{megatron-bridge,megatron-lm,torchtitan}.txt with the best layout's exports, which it
also copies into docs/launch.md between the <!-- export:FORMAT --> markers it has.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import k3opt
from k3opt.launch import FORMATS, to_launch

DOCS = Path(__file__).resolve().parent
LAUNCH_DOC = DOCS / "launch.md"


def write_exports(layout: k3opt.Layout) -> None:
    (DOCS / "launch").mkdir(exist_ok=True)
    doc = LAUNCH_DOC.read_text()
    for fmt in FORMATS:
        text = to_launch(layout, fmt).text
        (DOCS / "launch" / f"default-plan.{fmt}.txt").write_text(text)
        lang = "toml" if fmt == "torchtitan" else "bash"
        block = f"<!-- export:{fmt} -->\n```{lang}\n{text.rstrip()}\n```\n<!-- /export:{fmt} -->"
        doc = re.sub(rf"<!-- export:{fmt} -->.*?<!-- /export:{fmt} -->", lambda _m, b=block: b, doc, flags=re.S)
    LAUNCH_DOC.write_text(doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=300.0)
    ap.add_argument("--layout", default=None, help="Only refresh the exports, from this layout file.")
    args = ap.parse_args()
    if args.layout:
        write_exports(k3opt.load_layout(args.layout))
        print("wrote docs/launch/default-plan.*.txt and docs/launch.md's export block")
        return
    from k3opt.report.plots import ledger_plot, pareto_plot, timeline_plot

    plan = k3opt.pareto(k3opt.load_job("k3-512-4k"), top=1, time_limit=args.time_limit)
    best = plan.layouts[0]
    print(f"status {plan.status}, best {best.rank_time_s:.3f} s ranked ({best.step_time_s:.3f} s roofline), "
          f"front of {len(plan.pareto)} layouts")
    ledger_plot(best.evaluation, DOCS / "ledger.png")
    timeline_plot(best.evaluation, DOCS / "timeline.png")
    pareto_plot(plan.pareto, DOCS / "pareto.png", best=best)
    write_exports(best.layout)
    print("wrote docs/ledger.png, timeline.png, pareto.png, docs/launch/default-plan.*.txt and docs/launch.md's "
          "export block")


if __name__ == "__main__":
    main()
