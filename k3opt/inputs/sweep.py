"""A sweep file: a job file plus a `[sweep]` table whose keys are job fields and whose values are lists; the grid
is their product, one job per point (`k3opt sweep`, k3opt.sweep).

Everything a user can get wrong in the file is found before any point runs (one line, SpecError): malformed TOML,
no `[sweep]` table, an unknown or repeated key, an empty list, a value of the wrong type, an unknown model or
cluster preset. A combination of valid values that no job allows (say 64 GPUs with a `domain_gpus_used` of 72)
is the point's own failure, recorded in its row."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from k3opt.inputs.errors import K3optError, SpecError
from k3opt.inputs.presets import format_validation_error, load_cluster, load_model, read_toml
from k3opt.inputs.specs import Job

SWEEP_KEYS: tuple[str, ...] = ("gpus", "racks", "context", "tokens_per_update", "model", "cluster", "reserve_gib",
                               "precisions", "target")
"""Job fields a `[sweep]` table may list values of."""


@dataclass(frozen=True)
class SweepPoint:
    """One point of the grid: its index, the swept values, and its job (None with `error` when the values make
    no valid job)."""

    index: int
    values: dict[str, Any]
    job: Job | None
    error: str | None = None

    def label(self) -> str:
        """The swept values as `key=value` words."""
        return " ".join(f"{k}={_text(v)}" for k, v in self.values.items())


@dataclass(frozen=True)
class Sweep:
    """A parsed sweep file: the base job's fields, the swept axes in file order, and where it came from."""

    base: dict[str, Any]
    axes: dict[str, list[Any]]
    path: str

    def size(self) -> int:
        n = 1
        for values in self.axes.values():
            n *= len(values)
        return n

    def points(self) -> list[SweepPoint]:
        """The grid, in the product order of the axes (the first axis slowest)."""
        out = []
        names = list(self.axes)
        for i, combo in enumerate(itertools.product(*self.axes.values())):
            values = dict(zip(names, combo, strict=True))
            fields = {**self.base, **values}
            fields["name"] = " ".join(w for w in (str(self.base.get("name", "")),
                                                  SweepPoint(i, values, None).label()) if w)
            try:
                out.append(SweepPoint(i, values, Job.model_validate(fields)))
            except ValidationError as err:
                out.append(SweepPoint(i, values, None, format_validation_error(err, "job", Job)))
        return out


def _text(v: Any) -> str:
    return "+".join(map(str, v)) if isinstance(v, list) else str(v)


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file (see the module docstring); SpecError or PresetNotFoundError on bad input."""
    p = Path(path)
    data = read_toml(p, "sweep")
    table = data.pop("sweep", None)
    if table is None:
        raise SpecError(f"sweep: {p} has no [sweep] table; add one whose keys are job fields and values lists, "
                        "e.g. [sweep] gpus = [512, 1024]")
    if not isinstance(table, dict) or not table:
        raise SpecError(f"sweep: {p}: [sweep] must be a table of lists, e.g. gpus = [512, 1024]")
    for key, values in table.items():
        if key not in SWEEP_KEYS:
            raise SpecError(f"sweep: [sweep] {key}: unknown key; the keys a sweep can list are "
                            f"{', '.join(SWEEP_KEYS)}")
        if not isinstance(values, list):
            raise SpecError(f"sweep: [sweep] {key}: must be a list of values, e.g. {key} = [{_example(key)}]")
        if not values:
            raise SpecError(f"sweep: [sweep] {key}: the list is empty; give at least one value")
        if key in data:
            raise SpecError(f"sweep: {key} is both a job field and a [sweep] key; keep one of them")
    _check_values(data, table)
    return Sweep(base=data, axes=dict(table), path=str(p))


def _example(key: str) -> str:
    return {"model": '"kimi-k3"', "cluster": '"gb200-nvl72"', "precisions": '["bf16"], ["bf16", "fp8"]',
            "target": '"megatron-bridge"', "reserve_gib": "4.0"}.get(key, "512, 1024")


def _check_values(base: dict[str, Any], axes: dict[str, list[Any]]) -> None:
    """Each listed value, set alone on the base job (the other axes at their first values), must be of its
    field's type; the base job with the first values must be valid apart from the swept fields; each model and
    cluster named must be a preset or file."""
    first = {k: v[0] for k, v in axes.items()}
    for key, values in axes.items():
        for i, value in enumerate(values):
            try:
                Job.model_validate({**base, **first, key: value})
            except ValidationError as err:
                bad = [e for e in err.errors() if e["loc"] and e["loc"][0] == key]
                if bad:
                    msg = format_validation_error(err, f"sweep: [sweep] {key}[{i}] = {value!r}")
                    raise SpecError(msg) from None
            try:
                if key == "model":
                    load_model(value)
                elif key == "cluster":
                    load_cluster(value)
            except K3optError as err:
                raise type(err)(f"sweep: [sweep] {key}[{i}]: {err}") from None
    try:
        Job.model_validate({**base, **first})
    except ValidationError as err:
        bad = [e for e in err.errors() if not (e["loc"] and e["loc"][0] in axes)]
        if bad and bad[0]["loc"]:
            raise SpecError(format_validation_error(err, "sweep: job", Job)) from None
    for key in ("model", "cluster"):
        if key in base and key not in axes:
            try:
                (load_model if key == "model" else load_cluster)(base[key])
            except K3optError as err:
                raise type(err)(f"sweep: {key}: {err}") from None
