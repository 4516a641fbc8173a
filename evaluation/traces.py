"""The Parquet side of a bench run: one row per decoding step (traces) and per generation, hive-partitioned by
run and method, appended one part per prompt so an interrupted run keeps what finished."""

from __future__ import annotations

import os
from pathlib import Path


def _schemas():
    import pyarrow as pa

    s, i, f, b = pa.string(), pa.int32(), pa.float64(), pa.bool_()
    gen = pa.schema(
        [
            ("kind", s),
            ("prompt_id", s),
            ("category", s),
            ("repeat", i),
            ("worker", s),
            ("new_tokens", i),
            ("wall_s", f),
            ("prefill_s", f),
            ("draft_s", f),
            ("verify_s", f),
            ("target_forwards", i),
            ("steps", i),
            ("identical", b),
            ("first_diff", i),
            ("margin", f),
            ("suspicious", b),
            ("lossy", b),
            ("differ_share", f),
            ("large_share", f),
            ("finish_reason", s),
            ("config", s),
            ("peak_rss_mb", f),
            ("levels", s),
        ]
    )
    step = pa.schema(
        [
            ("prompt_id", s),
            ("category", s),
            ("repeat", i),
            ("worker", s),
            ("step", i),
            ("drafted", i),
            ("accepted", i),
            ("draft_s", f),
            ("verify_s", f),
            ("looked", pa.bool_()),  # prompt lookup's chain in place of a model drafter's (k=auto's glance)
            ("config", s),
        ]
    )
    return {"generations": gen, "traces": step}


def _partitioning():
    import pyarrow as pa
    import pyarrow.dataset as ds

    return ds.partitioning(pa.schema([("run", pa.string()), ("method", pa.string())]), flavor="hive")


class TraceWriter:
    """Appends one Parquet part per (table, method) per flush: OUT/<table>/run=<id>/method=<m>/part-<n>.parquet."""

    def __init__(self, out: Path, run_id: str):
        self.out, self.run_id, self.part = Path(out), run_id, 0
        self.schemas = _schemas()

    def write(self, gen_rows: list[dict], step_rows: list[dict]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        for table, rows in (("generations", gen_rows), ("traces", step_rows)):
            schema = self.schemas[table]
            for method in dict.fromkeys(r["method"] for r in rows):
                mine = [r for r in rows if r["method"] == method]
                d = self.out / table / f"run={self.run_id}" / f"method={method}"
                d.mkdir(parents=True, exist_ok=True)
                t = pa.Table.from_pylist([{k: r[k] for k in schema.names} for r in mine], schema=schema)
                tmp = d / f".part-{self.part:05d}.parquet.tmp"
                pq.write_table(t, tmp)
                os.replace(tmp, d / f"part-{self.part:05d}.parquet")  # a reader never sees half a file
        self.part += 1


def read_run(out: Path, run_id: str, table: str) -> list[dict]:
    """Rows of one run from OUT/<table> (hive-partitioned by run and method), as dicts with a ``method`` key."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    root = Path(out) / table / f"run={run_id}"
    if not root.is_dir():
        return []
    schema = pa.unify_schemas([_schemas()[table], pa.schema([("run", pa.string()), ("method", pa.string())])])
    dataset = ds.dataset(Path(out) / table, format="parquet", partitioning=_partitioning(), schema=schema)
    rows = dataset.to_table(filter=ds.field("run") == run_id).to_pylist()
    for r in rows:
        del r["run"]
    rows.sort(key=lambda r: (r["repeat"], r["prompt_id"], r["method"], r.get("step", 0)))
    return rows
