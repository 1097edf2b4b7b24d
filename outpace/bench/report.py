"""What every benchmark reports through: percentiles, the result table, the JSON file, the
progress bar, and the checks of the flags they share."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

from outpace.errors import ConfigError


def percentile(xs: list, p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation between the closest ranks (numpy's
    default, as vLLM reports them); 0.0 for no values."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo = int(math.floor(k))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def mean(xs: list) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def print_result(title: str, rows: list, out=None) -> None:
    """vLLM's result block: a title line, then one `label: value` line per (label, value); a
    float is printed with 2 decimals (4 below 1)."""
    out = out or sys.stdout
    width = 50
    print(f" {title} ".center(width, "="), file=out)
    for label, value in rows:
        if isinstance(value, float):
            value = f"{value:.4f}" if abs(value) < 1 else f"{value:.2f}"
        print(f"{label + ':':<40}{value:>10}", file=out)
    print("=" * width, file=out)


def check_output_json(path: Optional[str]) -> None:
    """--output-json's folder exists, and the path is no folder: checked before any work, so a
    run is not lost at its end."""
    if path is None:
        return
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"--output-json {path!r} is a folder; give a file name",
                          option="output_json")
    if not p.parent.is_dir():
        raise ConfigError(f"--output-json {path!r}: the folder {str(p.parent)!r} does not exist",
                          option="output_json")


def write_json(path: Optional[str], result: dict) -> None:
    if path is None:
        return
    payload = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **result}
    # JSON has no infinity: a float that is not finite is written as null (a benchmark writes
    # its own spelling first where it has one, as bench serve's "inf" request rate)
    Path(path).expanduser().write_text(json.dumps(_finite(payload), indent=2) + "\n")


def _finite(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def at_least(value, low: int, flag: str) -> None:
    """An integer flag's lower bound, as an error naming the flag."""
    if value is not None and value < low:
        raise ConfigError(f"{flag} must be an integer >= {low}, got {value}",
                          option=flag.lstrip("-").replace("-", "_"))


def progress(total: int, unit: str, quiet: bool):
    """A progress bar on stderr (tqdm), or none with --quiet."""
    from tqdm import tqdm
    return tqdm(total=total, unit=unit, disable=quiet, file=sys.stderr, dynamic_ncols=True,
                leave=False)
