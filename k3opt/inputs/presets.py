"""Loading the input files: shipped presets by name or TOML files by path, validated into k3opt.inputs.specs models.

A bad file is one clear line (SpecError, PresetNotFoundError); a cluster's or job's named runtime must exist.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from k3opt.inputs.errors import LayoutError, PresetNotFoundError, SpecError
from k3opt.inputs.specs import NO_RUNTIME, ClusterSpec, Job, Layout, ModelSpec, RuntimeSpec

DEFAULT_RUNTIME = "megatron-te-hybridep-gb200"
"""The shipped runtime preset (load_runtime's default); a job's default is its cluster's `default_runtime`."""


def format_validation_error(err: ValidationError, what: str, spec: type[BaseModel] | None = None) -> str:
    """One line for a validation error: `what`, the field's path and what is wrong; an unknown key of `spec` (the
    model validated) names the field it most likely misspells."""
    first = err.errors()[0]
    # Union members and validator chains appear in the location as "function-after[...]"; keep field names.
    # A rule over the whole file (a model validator) has no field to name.
    loc = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or str(p).isidentifier())
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        near = _nearest_field(spec, first["loc"])
        home = _home_of(spec, first["loc"]) if near is None else None
        msg = (f"unknown key (did you mean '{near}'?)" if near else
               f"unknown key here; {home}" if home else "unknown key (remove it or check its spelling)")
    elif first["type"] == "missing":
        msg = "required field is missing"
    extra = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{what}: {loc}: {msg}{extra}" if loc else f"{what}: {msg}{extra}"


def _nearest_field(spec: type[BaseModel] | None, loc: tuple) -> str | None:
    """The field of the (nested) model at loc[:-1] whose name is closest to the unknown key loc[-1] (difflib's
    ratio at least 0.75: `precision` for `precisions`, `gpu` for `gpus`), or None."""
    model = spec
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if model is not None else None
        ann = field.annotation if field is not None else None
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    if model is None or not loc:
        return None
    names = list(model.model_fields) + [f.alias for f in model.model_fields.values() if f.alias]
    near = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.75)
    return near[0] if near else None


def _home_of(spec: type[BaseModel] | None, loc: tuple) -> str | None:
    """Where an unknown key belongs when it is a field of the file elsewhere: the top level (for a key written
    under a table such as [search]) or a table of the top level (for a top-level key that is that table's), or
    None."""
    if spec is None or not loc:
        return None
    key = str(loc[-1])
    if len(loc) > 1 and key in spec.model_fields:
        return f"'{key}' is a top-level key: move it above the [{loc[0]}] table"
    for name, field in spec.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel) and key in ann.model_fields and (
                len(loc) == 1 or str(loc[0]) != name):
            return f"'{key}' belongs in the [{name}] table"
    return None


def read_toml(path: Path, what: str) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PresetNotFoundError(f"{what} file not found: {path}") from None
    except IsADirectoryError:
        raise SpecError(f"{what}: {path} is a directory, not a TOML file") from None
    if not text.strip():
        raise SpecError(f"{what}: {path} is empty; it needs at least the required fields")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise SpecError(f"{what}: {path} is not valid TOML ({err})") from None


_PRESET_DIRS = {"model": "constraints/models", "cluster": "constraints/clusters",
                "job": "constraints/jobs", "layout": "layouts", "runtime": "constraints/runtimes",
                "measured layout": "layouts/measured", "rates": "constraints/rates"}


def preset_dir(kind: str) -> Path:
    """The folder holding the shipped presets of one kind: inside the installed package, or the
    repository's top-level folder when k3opt runs from a source checkout."""
    rel = _PRESET_DIRS[kind]
    installed = Path(str(resources.files("k3opt"))) / rel
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parents[2] / rel


def preset_names(kind: str) -> list[str]:
    d = preset_dir(kind)
    return sorted(p.stem for p in d.glob("*.toml")) if d.is_dir() else []


def resolve(name_or_path: str | Path, kind: str) -> Path:
    """A path to an existing file, or the name of a shipped preset."""
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists() or "/" in str(name_or_path):
        if p.exists():
            return p
        raise PresetNotFoundError(f"{kind} file not found: {p}")
    kinds = (kind, "measured layout") if kind == "layout" else (kind,)
    for k in kinds:
        candidate = preset_dir(k) / f"{name_or_path}.toml"
        if candidate.exists():
            return candidate
    known = ", ".join(sorted(n for k in kinds for n in preset_names(k))) or "none"
    raise PresetNotFoundError(f"unknown {kind} preset '{name_or_path}'; known presets: {known} (or give a path)")


def load_spec(cls: type[BaseModel], name_or_path: str | Path, kind: str) -> Any:
    path = resolve(name_or_path, kind)
    return _validated(cls, read_toml(path, f"{kind} {path.name}"), f"{kind} {path.name}")


def _validated(cls: type[BaseModel], data: dict[str, Any], what: str) -> Any:
    """`cls` from a file's data; a validation error becomes one SpecError line naming `what`."""
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, what, cls)) from None


def load_model(name_or_path: str | Path = "kimi-k3") -> ModelSpec:
    """A model preset name (`kimi-k3`) or a path to a model TOML."""
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    return load_spec(ModelSpec, name_or_path, "model")


def shipped_model(model: ModelSpec) -> str | None:
    """The preset name `model` is, field for field but for the MTP layers a layout trains (`trained_model`; the
    exports write that count), or None: a model file that reuses a preset's name with other shapes is not that
    preset (the exports name a framework's recipe or flavor only for the model it builds)."""
    if model.name not in preset_names("model"):
        return None
    preset = load_model(model.name)
    return model.name if preset.model_copy(update={"mtp": model.mtp}) == model else None


def load_cluster(name_or_path: str | Path = "gb200-nvl72") -> ClusterSpec:
    """A cluster preset name (`gb200-nvl72`) or a path to a cluster TOML. Its `default_runtime`, if named, must
    exist."""
    if isinstance(name_or_path, ClusterSpec):
        return name_or_path
    cluster = load_spec(ClusterSpec, name_or_path, "cluster")
    if cluster.default_runtime not in (None, NO_RUNTIME):
        try:
            load_runtime(cluster.default_runtime)
        except (PresetNotFoundError, SpecError) as err:
            raise type(err)(f"cluster {cluster.name}: default_runtime: {err}") from None
    return cluster


def load_layout(name_or_path: str | Path) -> Layout:
    """A layout file (or the name of a shipped layout, e.g. `k3-gb200-512-reference`)."""
    return load_spec(Layout, name_or_path, "layout")


def load_job(name_or_path: str | Path = "k3-512-4k") -> Job:
    """A job file (or the name of a shipped job, e.g. `k3-512-4k`). Its runtime, if named, must exist; absent,
    the plan uses the cluster's `default_runtime` (k3opt.inputs.runtime.resolve_job_runtime)."""
    job = load_spec(Job, name_or_path, "job")
    if job.runtime not in (None, NO_RUNTIME):
        load_runtime(job.runtime)
    return job


def make_layout(**fields: Any) -> Layout:
    """Build a Layout from keyword fields, raising LayoutError (not a pydantic error) on bad input."""
    try:
        return Layout.model_validate(fields)
    except ValidationError as err:
        raise LayoutError(format_validation_error(err, "layout", Layout)) from None


def load_runtime(name_or_path: str | Path | RuntimeSpec = DEFAULT_RUNTIME) -> RuntimeSpec:
    """A runtime preset name (`megatron-te-hybridep-gb200`) or a path to a runtime TOML. A file that names a
    `base` runtime holds only what it changes: the base's fields, then its own (one level)."""
    if isinstance(name_or_path, RuntimeSpec):
        return name_or_path
    path = resolve(name_or_path, "runtime")
    data = read_toml(path, f"runtime {path.name}")
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise SpecError(f"runtime {path.name}: base must be a runtime preset name or file, not {base!r}")
        parent = read_toml(resolve(base, "runtime"), f"runtime {base}")
        if "base" in parent:
            raise SpecError(f"runtime {path.name}: its base {base} names a base itself; give the fields instead")
        data = {**parent, **data}
    return _validated(RuntimeSpec, data, f"runtime {path.name}")


def layout_toml(layout: Layout) -> str:
    """A layout as the TOML file load_layout reads back (its measurement left out): top-level fields, then
    [toggles]."""
    data = layout.model_dump(mode="json", exclude_none=True)
    toggles = data.pop("toggles")
    data.pop("measured", None)
    lines = ["# Saved by k3opt; `k3opt explain FILE` prints its ledger."]
    lines += [f"{k} = {json.dumps(v)}" for k, v in data.items()]
    lines += ["", "[toggles]"] + [f"{k} = {json.dumps(v)}" for k, v in toggles.items()]
    return "\n".join(lines) + "\n"
