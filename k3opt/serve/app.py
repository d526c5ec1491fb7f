"""`k3opt serve`: the planning lab, a FastAPI app over the library (docs/serve.md says why FastAPI).

The page (static/) sends its control values as a form; the API answers with evaluate()'s and plan()'s numbers in
the shapes the page draws (serve/views.py). Bad input gets the CLI's one-line message and the control it belongs
beside, as HTTP 400 with {"error", "field"}; no input stops the server."""

from __future__ import annotations

import inspect
import io
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import plotly
from fastapi import APIRouter, Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles

from k3opt.cost.evaluate import evaluate
from k3opt.inputs.errors import K3optError
from k3opt.inputs.presets import layout_toml, load_job, load_layout, preset_names
from k3opt.inputs.specs import TOGGLE_NAMES
from k3opt.inputs.toggles import TOGGLES
from k3opt.launch import FORMATS, to_launch
from k3opt.planner import plan
from k3opt.report.plots import sweep_plot
from k3opt.report.throughput import validate_throughput
from k3opt.report.validate import fit_rows, validation_rows
from k3opt.serve.forms import (
    CHOICE_CONTROLS,
    MAX_TIME_LIMIT_S,
    MAX_TOP,
    RUNTIME_CHOICES,
    TARGET_CHOICES,
    FieldError,
    job_from_form,
    layout_from_form,
)
from k3opt.serve.runs import Busy, Runs
from k3opt.serve.views import evaluation_view, form_of, plan_csv, plan_view, progress_view
from k3opt.sweep.store import read_rows

STATIC = Path(str(resources.files("k3opt.serve") / "static"))
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
"""plotly.js as the plotly wheel ships it: the page draws with it and needs no network."""
DEFAULT_LAYOUT = "k3-gb200-512-reference"
"""What the explorer opens on: the measured K3 reference run."""
DEFAULT_JOB = "k3-512-4k"
"""Whose tokens per update and launch target the Plan tab starts from: the CLI's default job."""
_PLAN_DEFAULTS = inspect.signature(plan).parameters
"""The Plan tab starts from k3opt.plan's own defaults (time limit, layouts)."""
FormBody = Annotated[Any, Body()]
"""A request body of control values (checked by serve/forms.py, not by FastAPI, so errors keep the CLI's words)."""
EXPORT_SUFFIX = {"megatron-bridge": ".txt", "megatron-lm": ".sh", "torchtitan": ".toml"}
"""Bridge overrides, Megatron-LM's command-line flags, torchtitan's job TOML."""
_CLIENT = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _error(err: K3optError, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": str(err).splitlines()[0] if str(err) else type(err).__name__,
                         "field": getattr(err, "field", None)}, status_code=status)


def _client(request: Request) -> str:
    """The page's own id (a random token it keeps per tab), else the peer's address."""
    given = request.headers.get("x-k3opt-client", "")
    if _CLIENT.fullmatch(given):
        return given
    return request.client.host if request.client else "unknown"


def _form(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise FieldError("the request body is a JSON object of control values")
    return body


def _options() -> dict[str, Any]:
    ref, job = load_layout(DEFAULT_LAYOUT), load_job(DEFAULT_JOB)
    return {
        "models": preset_names("model"), "clusters": preset_names("cluster"),
        "runtimes": list(RUNTIME_CHOICES) + preset_names("runtime"),
        "choices": {k: list(v) for k, v in CHOICE_CONTROLS.items()},
        "toggles": [{"name": t, "kind": TOGGLES[t].kind.value} for t in TOGGLE_NAMES],
        "targets": list(TARGET_CHOICES), "formats": list(FORMATS),
        "max_time_limit_s": MAX_TIME_LIMIT_S, "max_top": MAX_TOP,
        "default": {**form_of(ref, "cluster-default"), "tokens_per_update": job.tokens_per_update,
                    "target": job.target or "none", "time_limit": _PLAN_DEFAULTS["time_limit"].default,
                    "top": _PLAN_DEFAULTS["top"].default},
    }

def create_app(sweeps: list[Path] | None = None, max_running: int = 2) -> FastAPI:
    """The lab's app; `sweeps`: sweep output files (.csv / .parquet) whose table and picture the page shows; at most
    `max_running` plans run at once."""
    runs = Runs(max_running)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        runs.shutdown()

    app = FastAPI(title="k3opt planning lab", docs_url="/api/docs", redoc_url=None, lifespan=lifespan)
    app.state.runs = runs
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    _errors(app)
    for router in (_pages(), _explore(), _plans(runs), _reports(list(sweeps or []))):
        app.include_router(router)
    return app


def _errors(app: FastAPI) -> None:
    """Bad input: one line and the control it belongs beside (400; 429 when every plan slot is taken); anything else
    a 500 with one line. The server goes on either way."""

    @app.exception_handler(K3optError)
    async def _k3opt_error(_: Request, err: K3optError) -> JSONResponse:
        return _error(err, 429 if isinstance(err, Busy) else 400)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        what = "is not JSON" if first.get("type") == "json_invalid" else "is not what this endpoint takes"
        return JSONResponse({"error": f"the request body {what}: {first.get('msg', '')}", "field": None},
                            status_code=400)

    @app.exception_handler(Exception)
    async def _internal(_: Request, err: Exception) -> JSONResponse:
        return JSONResponse({"error": f"internal error: {type(err).__name__}: {err}", "field": None},
                            status_code=500)



def _pages() -> APIRouter:
    """The page, plotly.js and the controls' choices."""
    r = APIRouter()

    @r.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @r.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:
        return Response(status_code=204)

    @r.get("/vendor/plotly.min.js", include_in_schema=False)
    def plotly_js() -> FileResponse:
        return FileResponse(PLOTLY_JS, media_type="text/javascript")

    @r.get("/api/options")
    def options() -> dict[str, Any]:
        """The controls' choices and the reference layout's values."""
        return _options()

    return r


def _explore() -> APIRouter:
    """One layout: evaluate() for the explorer, and its downloads."""
    r = APIRouter()

    @r.post("/api/evaluate")
    def api_evaluate(body: FormBody, full: bool = False) -> dict[str, Any]:
        """One layout's ledger, step time and timeline (evaluate()); `?full=1` adds evaluate()'s whole record, as
        `k3opt explain --json` prints it."""
        layout, model, cluster, runtime = layout_from_form(_form(body))
        ev = evaluate(layout, model, cluster, runtime=runtime if runtime is not None else "none")
        out = {"form": form_of(layout, _form(body).get("runtime")), "view": evaluation_view(ev)}
        if full:
            out["evaluation"] = json.loads(json.dumps(ev.to_dict(), default=float))
        return out

    @r.post("/api/download/{what}")
    def download(what: str, body: FormBody) -> Response:
        """The explorer's layout as a layout TOML (`toml`) or a launch export (megatron-bridge | megatron-lm |
        torchtitan)."""
        layout, model, _, _ = layout_from_form(_form(body))
        if what == "toml":
            return PlainTextResponse(layout_toml(layout), headers=_attachment("layout.toml"))
        if what not in FORMATS:
            raise FieldError(f"unknown download '{what}'; one of toml, {', '.join(FORMATS)}")
        launch = to_launch(layout, what, model)
        return PlainTextResponse(launch.text, headers=_attachment(f"{what}{EXPORT_SUFFIX[what]}"))

    return r


def _plans(runs: Runs) -> APIRouter:
    """Plans and fronts: start (cancelling the client's running one), state, cancel, CSV."""
    r = APIRouter()

    @r.post("/api/plans")
    def start_plan(request: Request, body: FormBody) -> dict[str, Any]:
        """Start a plan (`"pareto": true`: the front) for this client; its running plan, if any, is cancelled."""
        form = _form(body)
        job, model, cluster, top, limit = job_from_form(form)
        run = runs.start(_client(request), bool(form.get("pareto")), job, model, cluster, top, limit)
        return run.to_dict()

    @r.get("/api/plans/{run_id}")
    def plan_state(run_id: str) -> dict[str, Any]:
        """A plan's state: its live progress while it runs, its layouts and front once done."""
        run = _run(runs, run_id)
        out = run.to_dict()
        out["progress"] = progress_view(run.progress) if run.progress is not None else None
        out["result"] = plan_view(run.result) if run.result is not None and run.state == "done" else None
        return out

    @r.post("/api/plans/{run_id}/cancel")
    def cancel_plan(run_id: str) -> dict[str, Any]:
        return _run(runs, run_id, cancel=True).to_dict()

    @r.get("/api/plans/{run_id}/csv")
    def plan_csv_file(run_id: str) -> Response:
        """The plan's CSV: the ranked layouts (`k3opt plan`'s columns) or the front (`k3opt pareto --csv`)."""
        run = _run(runs, run_id)
        if run.result is None or run.state != "done":
            raise FieldError(f"plan {run_id} is {run.state}; its CSV exists once it is done")
        return PlainTextResponse(plan_csv(run.result, run.pareto), media_type="text/csv",
                                 headers=_attachment(f"{'pareto' if run.pareto else 'plan'}-{run_id}.csv"))

    return r


def _reports(sweep_files: list[Path]) -> APIRouter:
    """The validation of the measured layouts, and the sweeps given at start."""
    r = APIRouter()

    @r.get("/api/validation")
    def validation() -> dict[str, Any]:
        """The measured layouts: memory and throughput, modeled against measured with the GAP, and what fits."""
        tp = validate_throughput()
        return {"memory": [r.to_dict() for r in validation_rows()], "throughput": tp.to_dict(),
                "fit": [r.to_dict() for r in fit_rows()]}

    @r.get("/api/sweeps")
    def sweep_list() -> list[dict[str, Any]]:
        """The sweeps the server was started with: each one's best-layout rows."""
        return [_sweep(i, p) for i, p in enumerate(sweep_files)]

    @r.get("/api/sweeps/{index}.png")
    def sweep_png(index: int) -> Response:
        if not 0 <= index < len(sweep_files):
            raise FieldError(f"no sweep {index}; the server has {len(sweep_files)}")
        buf = io.BytesIO()
        sweep_plot(read_rows(sweep_files[index]), buf)
        return Response(buf.getvalue(), media_type="image/png")

    return r



SWEEP_COLUMNS = ("status", "gap", "pp", "vp", "cp", "ep", "expert_fsdp", "dense_fsdp", "microbatches", "recompute",
                 "ranked_step_time_s", "ranked_tokens_per_s_per_gpu_held", "train_days", "reason")


def _sweep(i: int, path: Path) -> dict[str, Any]:
    df = read_rows(path)
    best = df[df["rank"].isna() | (df["rank"] == 1)] if "rank" in df.columns else df
    cols = [c for c in best.columns if c.startswith("sweep_")] + [c for c in SWEEP_COLUMNS if c in best.columns]
    rows = best[cols].astype(object).where(best[cols].notna(), None).to_dict(orient="records")
    return {"index": i, "file": path.name, "columns": cols, "rows": rows, "png": f"/api/sweeps/{i}.png"}


def _run(runs: Runs, run_id: str, cancel: bool = False):  # noqa: ANN202 - PlanRun
    run = runs.cancel(run_id) if cancel else runs.get(run_id)
    if run is None:
        raise FieldError(f"no plan {run_id} on this server (finished plans are kept for a while, then dropped)")
    return run


def _attachment(name: str) -> dict[str, str]:
    return {"Content-Disposition": f'attachment; filename="{name}"'}


__all__ = ["create_app"]
