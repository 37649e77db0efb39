"""One JSON object per line: the telemetry file written by the recorder and read by the advisor."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def _finite(value):
    """NaN/inf are not JSON; write them as null so every reader can parse the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def append_row(path: str | os.PathLike, row: dict) -> None:
    """Append ``row`` as one line and flush, so a crashed run keeps every finished step."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(_finite(row), separators=(",", ":")) + "\n")
        f.flush()


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Every row of a telemetry file; ``ValueError`` naming the file and line when one is bad."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"telemetry file {p} does not exist: pass the file the loop wrote "
                                f"with --telemetry (one JSON object per step)")
    rows = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}:{lineno} is not JSON ({exc.msg}): each line must be one step's object") from None
        if not isinstance(row, dict):
            raise ValueError(f"{p}:{lineno} is a {type(row).__name__}, not a JSON object")
        rows.append(row)
    if not rows:
        raise ValueError(f"telemetry file {p} has no rows: run at least one step with telemetry on")
    return rows
