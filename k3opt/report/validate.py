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
from k3opt.inputs.presets import load_layout, preset_dir


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


def rows_text(rows: list[ValidationRow]) -> str:
    import pandas as pd

    if not rows:
        return "no measured layouts"
    df = pd.DataFrame([{
        "layout": r.layout, "figure": r.figure, "kind": r.kind, "modeled": r.modeled, "measured": r.measured,
        "unit": r.unit, "GAP": r.gap, "GAP %": r.gap_pct} for r in rows])
    return df.to_string(index=False, float_format=lambda x: f"{x:,.2f}")
