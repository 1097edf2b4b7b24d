"""Where a sampled graph's extra time goes: the sampling of [n, 49152] logits rows as the fused
step's sampled graphs run it (runner/fused_step.py `_sample`), in parts, in CUDA graphs. No model.

    PYTHONPATH=$PWD python3 benchmarks/diag_sampling.py --out $OUT

Variants, each 20 to a graph: `argmax` (a greedy graph's token), `race` (the noisy argmax
alone), `temp_race` (what a sampled graph runs: the same with the temperature),
`temp_minp_race` (and min-p: no sort), `full` (what a masked graph runs: temperature, top-k /
top-p by the stable sort, min-p, the race), `sort` (the sort alone), `masked` (the same
draw as `full` by kernels/masked_gumbel.py, what a masked graph runs now), and top-k alone and
top-k with top-p both ways; how many tokens the two ways share; then the kernel tables of one
`full` and one `masked` replay. Writes $OUT/diag_sampling.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DEV = "cuda"
VOCAB = 49152


def variants(n: int):
    from outpace.kernels.argmax import argmax_rows
    from outpace.sample.logits_processing import apply_min_p, apply_sampling_params
    from outpace.sample.gumbel import masked_race_tokens, race_tokens
    g = torch.Generator(device=DEV).manual_seed(n)
    logits = torch.randn(n, VOCAB, device=DEV, generator=g) * 3
    temp = torch.full((n,), 0.8, device=DEV)
    top_k = torch.zeros(n, dtype=torch.long, device=DEV)
    top_p = torch.full((n,), 0.9, device=DEV)
    min_p = torch.full((n,), 0.05, device=DEV)
    words = torch.full((n,), 12345, dtype=torch.long, device=DEV)
    pos = torch.arange(n, device=DEV)

    def full(k=top_k, p=top_p, m=min_p):
        processed = apply_sampling_params(logits, temp, k, p, m)
        return race_tokens(processed, words, pos, pos_offset=1)

    def masked(k=top_k, p=top_p, m=min_p):
        return masked_race_tokens(logits, words, pos, temp, k, p, m, pos_offset=1)
    k50 = torch.full((n,), 50, dtype=torch.long, device=DEV)
    p_off, m_off = torch.ones_like(top_p), torch.zeros_like(min_p)

    def temp_race():
        return race_tokens(logits, words, pos, temperature=temp, pos_offset=1)

    def temp_minp_race():
        return race_tokens(apply_min_p(logits / temp.unsqueeze(1), min_p), words, pos,
                           pos_offset=1)

    return {"argmax": lambda: argmax_rows(logits),
            "race": lambda: race_tokens(logits, words, pos),
            "temp_race": temp_race, "temp_minp_race": temp_minp_race,
            "sort": lambda: logits.sort(dim=-1, descending=True, stable=True),
            "full": full, "masked": masked,
            "full_top_k": lambda: full(k50, p_off, m_off),
            "masked_top_k": lambda: masked(k50, p_off, m_off),
            "full_top_k_top_p": lambda: full(k50, top_p, m_off),
            "masked_top_k_top_p": lambda: masked(k50, top_p, m_off)}


def time_graph(fn, reps: int = 20, rounds: int = 5) -> tuple:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return graph, sorted(times)[rounds // 2]


def kernel_table(fn) -> list:
    from torch.profiler import ProfilerActivity, profile
    graph, _ = time_graph(fn, reps=1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            r = rows.setdefault(e.name[:70], [0, 0.0])
            r[0] += 1
            r[1] += e.device_time
    return sorted(([name, c // 10, round(t / 10, 2)] for name, (c, t) in rows.items()),
                  key=lambda r: -r[2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", default="1,3,8,32")
    ap.add_argument("--sweep", action="store_true",
                    help="also time `masked` over (CHUNK, the descent's warps)")
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "time": time.strftime("%Y-%m-%d %H:%M:%S"), "us_per_call": {}, "kernels": {}}
    for n in [int(x) for x in args.rows.split(",")]:
        fns = variants(n)
        for name, fn in fns.items():
            us = time_graph(fn)[1]
            out["us_per_call"][f"{name}_n{n}"] = round(us, 2)
            print(f"n={n:3d} {name:16s} {us:8.2f} us", flush=True)
        for a, b in (("full", "masked"), ("full_top_k", "masked_top_k"),
                     ("full_top_k_top_p", "masked_top_k_top_p")):
            same = int((fns[a]() == fns[b]()).sum())
            out["us_per_call"][f"{b}_same_tokens_n{n}"] = same
            print(f"n={n:3d} {b}: {same} of {n} tokens equal the sort path's", flush=True)
        for name in ("full", "masked") if n in (1, 32) else ():
            table = kernel_table(fns[name])
            out["kernels"][f"{name}_n{n}"] = table
            print(f"{name}, n = {n}: {len(table)} kernel kinds, "
                  f"{sum(r[1] for r in table)} launches", flush=True)
            for kname, count, us in table[:25]:
                print(f"  {us:8.2f} us  x{count:<3d} {kname}", flush=True)
    if args.sweep:
        from outpace.kernels import masked_gumbel as masked_race
        shapes = [(block, warps, masked_race.SPAN) for block, warps in
                  ((2048, 8), (2048, 16), (4096, 8), (4096, 16), (4096, 32), (8192, 16))]
        shapes += [(4096, 32, span) for span in (1, 2, 8)]
        for block, warps, span in shapes:
            masked_race.CHUNK, masked_race.DESCENT_WARPS, masked_race.SPAN = block, warps, span
            for n in (1, 32):
                fns = variants(n)
                for name in ("masked", "masked_top_k", "masked_top_k_top_p"):
                    us = time_graph(fns[name])[1]
                    out["us_per_call"][f"sweep_{block}_{warps}_{span}_{name}_n{n}"] = round(us, 2)
                    print(f"CHUNK {block} warps {warps} SPAN {span} n={n:3d} {name:20s} "
                          f"{us:8.2f} us", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "diag_sampling.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
