"""Writing generated rows as a parquet file, whole or not at all (the generated datasets' one writer)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def write_rows(rows: list[dict], path: Path) -> Path:
    """`rows` to `path` through a temporary file renamed into place: a reader never sees half a file."""
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(path)
    return path
