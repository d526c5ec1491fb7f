"""Property-based fuzzing of the loaders, evaluate() and the CLI: every malformed model, cluster, runtime, layout
and job file gives a K3optError with a one-line message (exit status 2 from the CLI), never a traceback, a
pydantic or a numpy error. Fixed seed and bounded example counts keep it deterministic and fast."""

from __future__ import annotations

import copy
import json
import math
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import k3opt
from k3opt.cli import main
from k3opt.inputs.presets import load_runtime, resolve

DATA = Path(__file__).parent / "data"
TINY_MODEL = DATA / "tiny-moe.toml"
TINY_LAYOUT = {
    "gpus": 16, "pp": 2, "cp": 1, "ep": 4, "expert_fsdp": 2, "dense_fsdp": 4, "microbatches": 4, "rows": 1,
    "context": 2048, "split": [3, 3], "recompute": "full", "model": str(TINY_MODEL), "cluster": "gb200-nvl72",
    "runtime": "megatron-te-hybridep-gb200", "dense_sharding": "optim", "optimizer_shard_granularity": "tensor",
    "toggles": {"fp8_activations": True, "fused_situ": True},
    "measured": {"kind": "unstated", "peak_gib": 10.0, "rank": 1, "resident_gib": 5.0, "terms_gib": {"grads": 1.0}},
}

BAD_VALUES = ["64", "", "true", -1, 0, 3, 7, 1000, 2**40, 2.5, -0.5, math.inf, math.nan, True, False, [], [1, "a"], [0],
              {}, {"x": 1}, "full", "optim_grads"]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def _to_toml(d: dict[str, Any]) -> str:
    return "\n".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in d.items()) + "\n"


def _paths(d: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for k, v in d.items():
        out.append((*prefix, k))
        if isinstance(v, dict):
            out += _paths(v, (*prefix, k))
    return out


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """One to three mutations of `base`: delete a key, replace a value, or add an unknown key."""
    d = json.loads(json.dumps(base, default=str))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(d)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = d
        for k in path[:-1]:
            parent = parent[k]
        action = draw(st.sampled_from(["delete", "replace", "replace", "unknown"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "replace":
            parent[path[-1]] = copy.deepcopy(draw(st.sampled_from(BAD_VALUES)))
        else:
            parent["not_a_field"] = 1
    return d


def _base(kind: str, name: str) -> dict[str, Any]:
    return tomllib.loads(resolve(name, kind).read_text())


def _check_error(err: k3opt.K3optError) -> None:
    msg = str(err)
    assert msg and "\n" not in msg, msg


def _cli(args: list[str], expect_error: bool) -> None:
    result = CliRunner().invoke(main, args)
    assert "Traceback" not in result.output
    assert result.exit_code == (2 if expect_error else 0), result.output
    if expect_error:
        lines = [ln for ln in result.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("k3opt: error:"), result.output


def _run(loader, text: str, then=None, cli=None) -> None:  # noqa: ANN001
    """Load (and use) a fuzzed file: success or one K3optError line; the CLI (`cli(path)` gives its arguments,
    or None to skip) exits 2 with one line exactly when the library raised."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "input.toml"
        path.write_text(text)
        failed = False
        try:
            obj = loader(path)
            if then is not None:
                then(obj)
        except k3opt.K3optError as err:
            _check_error(err)
            failed = True
        if cli is not None:
            args = cli(path)
            if args is not None and (failed or then is not None):
                _cli(args, failed)


def _tiny_layout_file(tmp: Path, drop: str) -> str:
    path = tmp / "tiny-layout.toml"
    path.write_text("\n".join(f"{k} = {_toml_value(v)}" for k, v in TINY_LAYOUT.items() if k != drop) + "\n")
    return str(path)


FUZZ = settings(max_examples=40, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@FUZZ
@given(mutated(TINY_LAYOUT))
def test_fuzz_layout_loader_evaluate_and_cli(data):
    text = _to_toml(data)
    _run(k3opt.load_layout, text, lambda lay: k3opt.evaluate(lay))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "layout.toml"
        path.write_text(text)
        result = CliRunner().invoke(main, ["explain", str(path), "--json"])
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        lines = [ln for ln in result.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("k3opt: error:"), result.output


@FUZZ
@given(data=mutated(tomllib.loads(TINY_MODEL.read_text())))
def test_fuzz_model_loader_and_evaluate(data, tmp_path):
    layout = k3opt.make_layout(**{k: v for k, v in TINY_LAYOUT.items() if k not in ("model", "measured")})
    lay_file = _tiny_layout_file(tmp_path, "model")
    _run(k3opt.load_model, _to_toml(data), lambda m: k3opt.evaluate(layout, model=m),
         lambda p: ["explain", lay_file, "--model", str(p), "--json"])


@FUZZ
@given(data=mutated(_base("cluster", "gb200-nvl72")))
def test_fuzz_cluster_loader_and_evaluate(data, tmp_path):
    layout = k3opt.make_layout(**{k: v for k, v in TINY_LAYOUT.items() if k != "cluster"})
    lay_file = _tiny_layout_file(tmp_path, "cluster")
    _run(k3opt.load_cluster, _to_toml(data), lambda c: k3opt.evaluate(layout, cluster=c),
         lambda p: ["explain", lay_file, "--cluster", str(p), "--json"])


@FUZZ
@given(data=mutated(_base("runtime", "megatron-te-hybridep-gb200")))
def test_fuzz_runtime_loader_and_evaluate(data, tmp_path):
    layout = k3opt.make_layout(**TINY_LAYOUT)
    lay_file = _tiny_layout_file(tmp_path, "runtime")
    _run(load_runtime, _to_toml(data), lambda rt: k3opt.evaluate(layout, runtime=rt),
         lambda p: ["explain", lay_file, "--runtime", str(p), "--json"])


@FUZZ
@given(mutated(_base("job", "k3-512-4k")))
def test_fuzz_job_loader(data):
    # The CLI runs only for jobs that fail to load (a valid job would start a full search).
    _run(k3opt.load_job, _to_toml(data), None, lambda p: ["plan", str(p)])


@pytest.mark.parametrize(("field", "value"), [("cp", '"64"'), ("gpus", "512.0"), ("pp", "true"),
                                               ("reserve_gib", '"1"')])
def test_string_or_bool_where_a_number_belongs_is_an_error(tmp_path, field, value):
    lines = [f"{k} = {_toml_value(v)}" for k, v in TINY_LAYOUT.items() if k != field]
    path = tmp_path / "layout.toml"
    path.write_text("\n".join([*lines, f"{field} = {value}"]) + "\n")
    with pytest.raises(k3opt.SpecError, match=field):
        k3opt.load_layout(path)
    result = CliRunner().invoke(main, ["explain", str(path)])
    assert result.exit_code == 2 and field in result.output


def test_string_where_a_bool_belongs_is_an_error(tmp_path):
    path = tmp_path / "layout.toml"
    lines = [f"{k} = {_toml_value(v)}" for k, v in TINY_LAYOUT.items() if k != "toggles"]
    path.write_text("\n".join([*lines, 'toggles = {fused_situ = "true"}']) + "\n")
    with pytest.raises(k3opt.SpecError, match="toggles.fused_situ"):
        k3opt.load_layout(path)


@pytest.mark.parametrize("fields", [dict(gpus=12, pp=8), dict(gpus=16, ep=32), dict(gpus=16, dense_fsdp=3),
                                    dict(gpus=16, cp=3), dict(gpus=16, pp=2, split=[6])])
def test_degrees_that_do_not_tile_are_layout_errors(fields):
    base = {k: v for k, v in TINY_LAYOUT.items() if k not in ("measured",)}
    with pytest.raises(k3opt.LayoutError):
        k3opt.evaluate(k3opt.make_layout(**{**base, **fields}))
