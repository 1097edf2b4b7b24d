"""Plot a GPU benchmark's JSON (benchmarks/bench_gpu.py) as a PNG: tokens/s against batch size
for every outpace configuration, with HF transformers' points, and TPOT at batch 1.

    python benchmarks/plot_gpu.py RUN.json [MORE.json ...] [--out FILE.png]

Several files are merged (e.g. the smol section of one run and the HF section of another).

Needs matplotlib (not a dependency of outpace: pip install matplotlib).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import plot_args  # noqa: E402


def main():
    a, plt = plot_args(out_required=False)

    data, commits = {}, []
    for f in a.json:
        d = json.loads(Path(f).read_text())
        commits.append(d.get("commit", "?"))
        data.update({k: v for k, v in d.items() if k not in data})
    rows = data.get("smol", [])
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    for c in configs:
        pts = sorted((r["batch"], r["tok_s"]) for r in rows if r["config"] == c)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"outpace {c}")
    for r in data.get("hf", []):
        ax.scatter([r["batch"]], [r["tok_s"]], marker="x", s=80, zorder=5,
                   label=f"HF {r['config']} (batch {r['batch']})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"SmolLM2-135M bf16, {data.get('device', '')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)

    b1 = [r for r in rows if r["batch"] == 1]
    names = [r["config"] for r in b1]
    bx.barh(names, [r["tpot_ms"] for r in b1], label="TPOT (engine step / token)")
    if any(r.get("graph_ms") for r in b1):
        acc = [r.get("mean_acceptance_length") or 1.0 for r in b1]
        bx.barh(names, [(r.get("graph_ms") or 0) / m for r, m in zip(b1, acc)],
                label="graph replay / mean tokens per step", alpha=0.7)
    bx.set_xlabel("ms per output token, batch 1")
    bx.legend(fontsize=8)
    bx.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"outpace GPU benchmark, commits {', '.join(dict.fromkeys(commits))}")
    fig.tight_layout()
    out = a.out or str(Path(a.json[0]).with_suffix(".png"))
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
