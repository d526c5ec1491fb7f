"""Re-check named mutmut mutants against chosen test files only, the way mutmut runs a mutant (a forked child
with MUTANT_UNDER_TEST set, `pytest -x` inside mutants/), and record the verdicts in mutants/recheck.json.

    python bench/mutation_recheck.py --tests tests/test_x.py [--tests ...] NAME...   # or --survivors
    python bench/mutation_summary.py                                                 # counts the re-checks
    python bench/mutation_recheck.py --out mutants/confirm.json --tests ... NAME...  # verdicts kept apart

A full `mutmut run NAME...` re-runs every selected test that calls the mutated function (half a minute per
surviving mutant here) and, after the test selection in pyproject.toml changes, first drops every stored verdict;
this runs only the new tests, so a kill here is a kill by the selection too. Run from the repository root after
`bench/mutation.sh` has built mutants/.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
RECHECK = MUTANTS / "recheck.json"


def survivors() -> list[str]:
    names = []
    for meta in sorted((MUTANTS / "k3opt").glob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        names += [k for k, v in codes.items() if v == 0]
    return names


def run(names: list[str], tests: list[str], cpu_limit: int = 300) -> dict[str, str]:
    for t in {t.split("::")[0] for t in tests}:  # mutmut copies tests/ once; new test files must be copied in
        shutil.copy2(ROOT / t, MUTANTS / t)
    os.chdir(MUTANTS)
    sys.path.insert(0, str(MUTANTS))
    import pytest  # noqa: F401  (imported once in the parent, shared by the forked children)

    import k3opt  # noqa: F401

    # Collect once in the parent (as mutmut's fork server does): the children reuse the imported test modules.
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(1), os.dup(2)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *tests])
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
    out: dict[str, str] = {}
    for name in names:
        pid = os.fork()
        if pid == 0:
            # A mutant that loops forever (a loop counter reset) ends on a CPU-time limit, not wall time, so a
            # loaded machine does not turn a slow survivor into a timeout.
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit, cpu_limit + 10))
            os.environ["MUTANT_UNDER_TEST"] = name
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            rc = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests])
            os._exit(int(rc))
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        out[name] = ("survived" if rc == 0 else "killed" if rc == 1
                     else "timeout" if rc in (-signal.SIGXCPU, -signal.SIGKILL) else f"error {rc}")
        print(out[name], name, flush=True)
        _save({name: out[name]})  # after every mutant: a stopped re-check keeps what it found
    return out


def _save(new: dict[str, str]) -> None:
    verdicts = json.loads(RECHECK.read_text()) if RECHECK.exists() else {}  # read late: two runs may share it
    for name, v in new.items():
        if verdicts.get(name) != "killed":
            verdicts[name] = v
    tmp = RECHECK.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(verdicts, indent=1, sort_keys=True))
    os.replace(tmp, RECHECK)  # atomic: a parallel run never reads half a file


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tests", action="append", required=True,
                    help="a test file or node id (file::test; the cheapest discriminating test first saves time)")
    ap.add_argument("--survivors", action="store_true", help="every mutant mutmut recorded as survived")
    ap.add_argument("--out", help="verdict file (default mutants/recheck.json, the one mutation_summary.py reads); "
                    "another file keeps checks that are not survivor re-checks (e.g. confirming a timeout) apart")
    ap.add_argument("--cpu-limit", type=int, default=300, help="CPU seconds per mutant before it counts as a "
                    "timeout (killed, as mutmut counts one)")
    ap.add_argument("names", nargs="*")
    a = ap.parse_args()
    if a.out:
        global RECHECK
        RECHECK = Path(a.out).resolve()
    names = survivors() if a.survivors else a.names
    run(names, a.tests, a.cpu_limit)


if __name__ == "__main__":
    main()
