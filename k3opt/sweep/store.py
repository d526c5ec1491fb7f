"""The sweep's output file (.csv or .parquet): every finished point's rows, rewritten whole after each point
through a temporary file and an atomic rename, so a killed sweep loses nothing finished and a rerun into the same
file skips the points whose key (rows.point_key) it already holds."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pandas as pd

from k3opt.inputs.errors import SpecError

FORMATS = (".csv", ".parquet")
TEXT_COLUMNS = ("point_key", "split_layers", "reason", "target", "runtime", "precisions")


def check_out(path: str | Path) -> Path:
    """The output path, checked before any point runs: a .csv or .parquet file in an existing folder."""
    p = Path(path)
    if p.suffix not in FORMATS:
        raise SpecError(f"--out {p}: the sweep writes .csv or .parquet; name the file with one of those suffixes")
    if not p.parent.exists():
        raise SpecError(f"--out {p}: folder {p.parent} does not exist; create it first")
    if p.suffix == ".parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise SpecError("--out *.parquet needs pyarrow: pip install 'k3opt[parquet]', or write .csv") from None
    return p


class Store:
    """The rows of the points finished so far, in the output file."""

    def __init__(self, path: str | Path) -> None:
        self.path = check_out(path)
        self.rows: list[dict[str, Any]] = []
        if self.path.exists() and self.path.stat().st_size > 0:
            old = read_rows(self.path)
            if "point_key" not in old.columns:
                raise SpecError(f"--out {self.path} exists and is not a sweep output (no point_key column); "
                                "choose another file or remove it")
            self.rows = old.to_dict("records")

    def done(self) -> set[str]:
        """Keys of the points the file already holds."""
        return {str(r["point_key"]) for r in self.rows}

    def add(self, rows: list[dict[str, Any]]) -> None:
        """A finished point's rows, written at once (the whole file replaced)."""
        self.rows.extend(rows)
        self.write()

    def frame(self) -> pd.DataFrame:
        df = pd.DataFrame(self.rows)
        return df.sort_values(["point", "rank"], na_position="first", kind="stable").reset_index(drop=True) \
            if "rank" in df.columns else df.sort_values("point", kind="stable").reset_index(drop=True)

    def write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        df = self.frame()
        if self.path.suffix == ".csv":
            df.to_csv(tmp, index=False)
        else:
            df.to_parquet(tmp, index=False)
        os.replace(tmp, self.path)


def read_rows(path: str | Path) -> pd.DataFrame:
    """A sweep output file as a DataFrame."""
    p = Path(path)
    if p.suffix == ".csv":
        # A key or a one-stage split can look like a number; they are text.
        return pd.read_csv(p, dtype={c: str for c in TEXT_COLUMNS})
    if p.suffix == ".parquet":
        return pd.read_parquet(p)
    raise SpecError(f"{p}: a sweep output is .csv or .parquet")
