"""Per-module mutation score from mutmut's result files (mutants/k3opt/*.py.meta), as bench/mutation.md reports it.

    python bench/mutation_summary.py            # table per module, then the totals
    python bench/mutation_summary.py --list     # also every mutant not killed, with its status

Score = killed (a timeout counts as killed) / mutants checked. "no tests" (no selected test calls the function)
counts as not killed; "not checked" (a run stopped early) is left out and shown. Survivors that
bench/mutation_recheck.py later killed with new tests (mutants/recheck.json) are counted in "re-check kills" and
in the score after re-check; --list leaves them out.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout",
          -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", None: "not checked",
          -9: "timeout"}  # -9: SIGKILL at the hard CPU limit, one second after SIGXCPU (mutmut prints "segfault")
MODULES = ("cost/structure", "cost/coefficients", "cost/evaluate", "cost/schedule", "cost/comm", "cost/ledger",
           "inputs/pipeline_layout")
"""The modules of `[tool.mutmut] only_mutate`, under mutants/k3opt/."""


def main() -> None:
    root = Path(__file__).resolve().parent.parent / "mutants" / "k3opt"
    recheck_path = root.parent / "recheck.json"
    recheck = json.loads(recheck_path.read_text()) if recheck_path.exists() else {}
    rows, total, not_killed = [], Counter(), []
    for mod in MODULES:
        meta = root / f"{mod}.py.meta"
        if not meta.exists():
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        c = Counter(STATUS.get(v, "suspicious") for v in codes.values())
        c["re-check kills"] = sum(1 for k, v in codes.items() if STATUS.get(v) == "survived"
                                  and recheck.get(k) in ("killed", "timeout"))
        total.update(c)
        rows.append((mod, c))
        not_killed += [(k, STATUS.get(v, "suspicious")) for k, v in codes.items()
                       if STATUS.get(v, "suspicious") not in ("killed", "timeout", "not checked")
                       and recheck.get(k) not in ("killed", "timeout")]
    print("| module | mutants | checked | killed | timeout | survived | no tests | not checked | score "
          "| re-check kills | score after re-check |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mod, c in [*rows, ("total", total)]:
        n = sum(v for k, v in c.items() if k != "re-check kills")
        checked = n - c["not checked"]
        kill = c["killed"] + c["timeout"]
        score = f"{100 * kill / checked:.1f}%" if checked else "-"
        after = f"{100 * (kill + c['re-check kills']) / checked:.1f}%" if checked else "-"
        print(f"| {mod} | {n} | {checked} | {c['killed']} | {c['timeout']} | {c['survived']} | {c['no tests']} "
              f"| {c['not checked']} | {score} | {c['re-check kills']} | {after} |")
    if "--list" in sys.argv:
        for key, status in not_killed:
            print(f"{status}\t{key}")


if __name__ == "__main__":
    main()
