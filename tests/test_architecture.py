"""The package boundaries: each package imports only the layers below it, no module imports another module's
private names, and no k3opt import hides inside a function (the way an import cycle gets dodged)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "k3opt"

# Each top-level part of k3opt and the parts it may import. inputs is the bottom layer; the CLI is the top.
ALLOWED = {
    "inputs": {"inputs"},
    "cost": {"inputs", "cost"},
    "search": {"inputs", "cost", "search"},
    "launch": {"inputs", "launch"},
    "planner": {"inputs", "search", "launch"},
    "report": {"inputs", "cost", "search", "report"},
    "sweep": {"inputs", "search", "planner", "sweep"},
    "serve": {"inputs", "cost", "search", "launch", "planner", "report", "sweep", "serve"},
    "cli": {"inputs", "cost", "search", "launch", "planner", "report", "sweep", "serve"},
    "__init__": {"inputs", "cost", "search", "launch", "planner"},
}
# The imports left inside a function: matplotlib loads only when a picture is asked for, and the web stack (the
# `serve` extra) only for `k3opt serve`.
LAZY_ALLOWED = {("cli.py", "k3opt.report"), ("cli.py", "k3opt.serve")}


def _modules() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def _part(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("").parts
    return rel[0]


def _imports(path: Path) -> list[tuple[ast.ImportFrom, bool]]:
    """Every `from k3opt... import` of the file, with whether it sits inside a function."""
    tree = ast.parse(path.read_text())
    out: list[tuple[ast.ImportFrom, bool]] = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom) and child.module and child.module.split(".")[0] == "k3opt":
                out.append((child, in_function))
            walk(child, inner)

    walk(tree, False)
    return out


def test_every_part_of_k3opt_has_a_layer() -> None:
    assert {_part(p) for p in _modules()} == set(ALLOWED)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_module_imports_only_the_layers_below_it(path: Path) -> None:
    part = _part(path)
    for node, _ in _imports(path):
        target = node.module.split(".")[1] if "." in node.module else "__init__"
        assert target in ALLOWED[part], f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module} ({part} " \
                                        f"may import {sorted(ALLOWED[part])})"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_another_modules_private_names(path: Path) -> None:
    for node, _ in _imports(path):
        private = [a.name for a in node.names if a.name.startswith("_")]
        assert not private, f"{path.relative_to(ROOT)}:{node.lineno} imports {private} from {node.module}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_k3opt_import_inside_a_function(path: Path) -> None:
    for node, in_function in _imports(path):
        if in_function:
            assert (path.name, node.module) in LAZY_ALLOWED, \
                f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module} inside a function"


def test_the_checks_see_a_violation(tmp_path: Path) -> None:
    """The walker finds a private import nested in a function: the three checks above are not vacuous."""
    src = "def f():\n    from k3opt.cost.coefficients import _x\n"
    tmp = tmp_path / "probe.py"
    tmp.write_text(src)
    (node, in_function), = _imports(tmp)
    assert in_function and node.module == "k3opt.cost.coefficients" and node.names[0].name == "_x"


# Numbers at module level in k3opt/search that are not tuning knobs: units and tolerances of the models, the
# default gap a user sets, and the helper process's OS settings.
NOT_KNOBS = {"MEM_UNIT", "TIME_UNIT", "PEAK_TIE_UNIT", "SCALE", "LINE_ROUNDING", "STOP_ROUNDING", "FEAS_TOL",
             "VECTOR_MARGIN", "DEFAULT_GAP", "LOCK_WAIT_S", "PIPE_BYTES", "PROVEN_TOL", "LOAD_TOL"}


def test_every_search_knob_lives_in_the_policy_with_its_reason() -> None:
    from dataclasses import FrozenInstanceError, fields

    from k3opt.search.policy import POLICY, SearchPolicy

    tree = ast.parse((ROOT / "search" / "policy.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SearchPolicy")
    documented = {a.target.id for a, doc in zip(cls.body, cls.body[1:], strict=False)
                  if isinstance(a, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)}
    assert documented == {f.name for f in fields(SearchPolicy)}
    with pytest.raises(FrozenInstanceError):
        POLICY.seed_share = 0.5  # type: ignore[misc]
    stray = []
    for path in sorted((ROOT / "search").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, (int, float)) and not isinstance(node.value.value, bool):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                stray += [f"{path.name}:{n}" for n in names if n.isupper() and n.lstrip("_") not in NOT_KNOBS
                          and not n.startswith("_")]
    assert not stray, f"tuning constants outside SearchPolicy: {stray}"
