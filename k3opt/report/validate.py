"""`k3opt validate`: every layout in layouts/measured/ evaluated and compared with what its run measured.

Each row is one figure: modeled vs measured, the measurement kind compared (allocated / reserved / device for
memory; "unstated" peaks give a reserved and a device row), and the GAP (measured - modeled) in the figure's
unit and in % of measured. Nothing is scaled to close a GAP. Rows are plain dataclasses so that other figures
(throughput) can be added beside the memory rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from k3opt.cost.evaluate import Comparison, evaluate
from k3opt.inputs.presets import load_cluster, load_layout, preset_dir
from k3opt.inputs.specs import GIB, NO_RUNTIME


@dataclass(frozen=True)
class ValidationRow(Comparison):
    """One evaluate() comparison (its gap and gap_pct) with the measured layout it belongs to."""

    layout: str = ""

    def to_dict(self) -> dict:
        return {**asdict(self), "gap": self.gap, "gap_pct": self.gap_pct}


def measured_layouts(folder: str | Path | None = None) -> list[Path]:
    """The layout files of a folder of measured runs (default: the shipped layouts/measured/)."""
    d = Path(folder) if folder is not None else preset_dir("measured layout")
    return sorted(d.glob("*.toml"))


def validation_rows(folder: str | Path | None = None) -> list[ValidationRow]:
    """One row per measured figure of every layout in `folder`."""
    rows: list[ValidationRow] = []
    for path in measured_layouts(folder):
        layout = load_layout(path)
        ev = evaluate(layout)
        name = layout.name or path.stem
        rows += [ValidationRow(c.figure, c.modeled, c.measured, c.unit, c.kind or "-", layout=name)
                 for c in ev.validation]
    return rows


@dataclass(frozen=True)
class FitRow:
    """Whether a measured run fits its GPU as modeled: the worst rank's device peak (the ledger plus the runtime's
    memory outside live tensors: the layout's runtime, else its cluster's default) against the HBM. A run that ran
    and is judged not to fit is a memory term counted too large, or a saving the layout does not express.

    The device peak carries the runtime's allocator slack, a ratio measured on runs with room to spare: there the
    caching allocator keeps every freed block. Under pressure it frees its unused cached segments and retries the
    allocation (PyTorch c10/cuda/CUDACachingAllocator.cpp, DeviceCachingAllocator::malloc: "Free all non-split
    cached blocks and retry alloc"; torch.cuda.memory_stats counts them as num_alloc_retries), so a run whose live
    bytes and memory outside the allocator fit may still run: `floor_gib` is that line, and the verdict says how
    much fragmentation (reserved beyond allocated that cannot be freed) it leaves room for. No public figure
    gives that fragmentation, so such a run is reported, not judged fitting."""

    layout: str
    model: str
    cluster: str
    runtime: str
    device_gib: float
    hbm_gib: float
    stand_in_for: str | None = None
    """The GPU the run ran on when the cluster preset only stands in for it: no fit is claimed."""
    floor_gib: float | None = None
    """The worst rank's allocated bytes plus the memory outside the allocator: the device peak without slack."""
    allocated_gib: float | None = None
    """That rank's allocated bytes."""

    @property
    def fits(self) -> bool | None:
        return None if self.stand_in_for else self.device_gib <= self.hbm_gib

    @property
    def fits_after_cache_release(self) -> bool | None:
        """Live bytes and memory outside the allocator under the HBM (None: no fit claimed, or no floor given)."""
        if self.stand_in_for or self.floor_gib is None:
            return None
        return self.floor_gib <= self.hbm_gib

    @property
    def verdict(self) -> str:
        if self.stand_in_for:
            return f"n/a (ran on {self.stand_in_for})"
        if self.fits:
            return "yes"
        if self.fits_after_cache_release and self.allocated_gib:
            room = (self.hbm_gib - self.floor_gib) / self.allocated_gib  # type: ignore[operator]
            return f"with allocator retries (room for {100 * room:.1f}% fragmentation)"
        return "NO"

    def to_dict(self) -> dict:
        return {**asdict(self), "fits": self.fits, "fits_after_cache_release": self.fits_after_cache_release,
                "verdict": self.verdict}


def fit_rows(folder: str | Path | None = None) -> list[FitRow]:
    """One row per measured layout: modeled device peak against HBM."""
    rows = []
    for path in measured_layouts(folder):
        layout = load_layout(path)
        cluster = load_cluster(layout.cluster or "gb200-nvl72")
        runtime = layout.runtime or cluster.default_runtime or NO_RUNTIME
        ev = evaluate(layout, cluster=cluster, runtime=runtime)
        hardware = layout.measured.hardware if layout.measured else None
        # Per rank, the device line less the allocator slack (reserved beyond allocated); the worst rank's.
        floors = {r.rank: r.device_bytes - (r.reserved_bytes - r.allocated_bytes) for r in ev.ranks}
        worst = max(ev.ranks, key=lambda r: floors[r.rank])
        floor = floors[worst.rank]
        rows.append(FitRow(layout.name or path.stem, ev.model.name, cluster.name, runtime,
                           ev.peak_device_bytes / GIB, cluster.hbm_bytes / GIB, hardware, floor / GIB,
                           worst.allocated_bytes / GIB))
    return rows


def fit_text(rows: list[FitRow]) -> str:
    import pandas as pd

    df = pd.DataFrame([{"layout": r.layout, "model": r.model, "cluster": r.cluster, "runtime": r.runtime,
                        "device GiB": r.device_gib, "without slack GiB": r.floor_gib, "HBM GiB": r.hbm_gib,
                        "fits": r.verdict}
                       for r in rows])
    return df.to_string(index=False, float_format=lambda x: f"{x:,.1f}")


def rows_text(rows: list[ValidationRow]) -> str:
    import pandas as pd

    if not rows:
        return "no measured layouts"
    df = pd.DataFrame([{
        "layout": r.layout, "figure": r.figure, "kind": r.kind, "modeled": r.modeled, "measured": r.measured,
        "unit": r.unit, "GAP": r.gap, "GAP %": r.gap_pct} for r in rows])
    return df.to_string(index=False, float_format=lambda x: f"{x:,.2f}")
