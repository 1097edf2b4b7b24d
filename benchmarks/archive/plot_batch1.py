"""Batch-1 TPOT across GPU runs: a bar per (config, overlap) and run, from the `overlap`
section of bench_gpu.py JSONs (SmolLM2-shaped model), with the 8B-shaped ratio to its floor.

    python benchmarks/plot_batch1.py RUN.json [MORE.json ...] --out FILE.png

Needs matplotlib (not a dependency of outpace).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import plot_args  # noqa: E402


def main():
    a, plt = plot_args(out_required=True)

    runs = [(Path(f).stem, json.loads(Path(f).read_text())) for f in a.json]
    def key(r):  # rows of one config: overlap off/on, the qkv + rope + store kernel, PDL
        # (runs before run 8 had neither switch: both off)
        return r["config"], r["overlap"], r.get("fused_qkv_rope_store", False), r.get("pdl", False)

    keys = []
    for _, d in runs:
        for r in d.get("overlap", []):
            if key(r) not in keys:
                keys.append(key(r))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(16, 5), gridspec_kw={"width_ratios": [4, 1]})
    width = 0.8 / max(1, len(runs))
    for i, (name, d) in enumerate(runs):
        tpot = {key(r): r["tpot_ms"] for r in d.get("overlap", [])}
        xs = [j + i * width for j in range(len(keys))]
        ax.bar(xs, [tpot.get(k, 0) for k in keys], width,
               label=f"{name} ({str(d.get('commit', '?')).split()[0]})")
        big = d.get("big", {})
        if "ratio_to_floor_overlap" in big:
            bx.bar([i], [big["ratio_to_floor_overlap"]], 0.6, label=name)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(keys))])
    ax.set_xticklabels([f"{c}\n{'overlap' if o else 'sync'}\n{'qkv-rope' if f else ''}"
                        f"{' PDL' if p else ''}" for c, o, f, p in keys], fontsize=7)
    ax.set_ylabel("TPOT ms (batch 1, lower is better)")
    ax.set_title("SmolLM2-135M-shaped, bf16, H200")
    ax.legend()
    bx.axhline(1.3, color="red", linestyle="--", label="goal 1.3x")
    bx.set_ylabel("TPOT / weight-bytes floor")
    bx.set_title("Llama-3.1-8B-shaped, batch 1, overlap")
    bx.set_xticks(range(len(runs)))
    bx.set_xticklabels([n for n, _ in runs], rotation=20, fontsize=7)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
