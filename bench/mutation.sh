#!/usr/bin/env bash
# Mutation score of the cost model (structure, coefficients, evaluate, schedule, comm) with mutmut; see
# bench/mutation.md. Run by hand from the repository root, never in CI:
#   pip install -e ".[dev,mutation]" && bench/mutation.sh [max-children]
# The [tool.mutmut] table in pyproject.toml names the modules and the fast test selection. Results stay in
# mutants/ (git-ignored); `mutmut results` lists the survivors, `mutmut show NAME` prints one.
set -euo pipefail
cd "$(dirname "$0")/.."
children="${1:-2}"
date -u +"started %Y-%m-%dT%H:%M:%SZ on $(uname -n), $(nproc) cores"
mutmut run --max-children "$children"
mutmut export-cicd-stats >/dev/null 2>&1 || true
python - <<'PY'
import json, pathlib
p = pathlib.Path("mutants/mutmut-cicd-stats.json")
if p.exists():
    s = json.loads(p.read_text())
    done = s["killed"] + s["survived"] + s.get("timeout", 0) + s.get("suspicious", 0)
    print(json.dumps(s))
    print(f"killed {s['killed']} + timeout {s.get('timeout', 0)} of {done} tested: "
          f"{100 * (s['killed'] + s.get('timeout', 0)) / max(done, 1):.1f}%")
PY
date -u +"finished %Y-%m-%dT%H:%M:%SZ"
