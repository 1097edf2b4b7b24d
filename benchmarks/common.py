"""Shared helpers of the benchmark scripts: prompts, environment facts, JSON output."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_prompts(name: str, n: int) -> list:
    """First n prompts of benchmarks/prompts/<name>.jsonl."""
    rows = [json.loads(line) for line in open(HERE / "prompts" / f"{name}.jsonl")]
    return [r["prompt"] for r in rows[:n]]


def git_commit() -> str:
    """OUTPACE_COMMIT when set (the device machine's copy of the tree may carry a stale .git),
    else the checkout's HEAD."""
    if os.environ.get("OUTPACE_COMMIT"):
        return os.environ["OUTPACE_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                                       text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("OUTPACE_COMMIT", "unknown")


def device_name(device: str) -> str:
    import torch
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU x{os.cpu_count()}"


def write_result(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"commit": git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def print_table(rows: list, cols: list) -> None:
    widths = [max([len(c)] + [len(f"{r.get(c, '')}") for r in rows]) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(f"{r.get(c, '')}".ljust(w) for c, w in zip(cols, widths)))


def plot_args(out_required: bool = True):
    """The plot scripts' command line (RUN.json ... --out FILE.png) and matplotlib.pyplot
    with the file-only backend -> (args, plt). matplotlib is not a dependency of outpace."""
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", required=out_required, default=None)
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return args, plt
