"""What a +logprobs graph's logprobs cost: kernels/logprobs.py's two passes against the torch
ops they replace (log_softmax, topk, gather, cat: row_logprobs_ref), on [n, 49152] float32
rows, 20 calls to a CUDA graph. No model. Checks the kernel's ids and values against the stable
reference first; then with a count of 0, 1 and 5 (a graph's: only the first of the top);
`--sweep` also times (CHUNK, WARPS, MERGE_WARPS) choices.

    PYTHONPATH=$PWD python3 benchmarks/diag_logprobs.py --out $OUT [--sweep]

Writes $OUT/diag_logprobs.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.archive.diag_sampling import kernel_table, time_graph  # noqa: E402

VOCAB = 49152
TOP = 20


def main() -> None:
    import outpace.kernels.logprobs as lp
    from tests.unit import logprobs_cases
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", default="1,3,8,24,96")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "time": time.strftime("%Y-%m-%d %H:%M:%S"), "us_per_call": {}, "kernels": {}}
    shapes = [(lp.CHUNK, lp.WARPS, lp.MERGE_WARPS)]
    if args.sweep:
        shapes += [(c, w, m) for c, w, m in ((2048, 4, 1), (2048, 4, 2), (2048, 4, 4),
                                             (1024, 4, 1), (1024, 2, 1), (1024, 4, 2),
                                             (4096, 8, 1), (512, 2, 1), (512, 4, 2))
                   if (c, w, m) != shapes[0]]
    for n in [int(x) for x in args.rows.split(",")]:
        logits, tokens = logprobs_cases.make_case(n, VOCAB, seed=n)
        logits, tokens = logits.cuda(), tokens.cuda()
        want = logprobs_cases.stable_ref(logits, tokens, TOP)
        us = time_graph(lambda: lp.row_logprobs_ref(logits, tokens, TOP))[1]
        out["us_per_call"][f"torch_n{n}"] = round(us, 2)
        print(f"n={n:3d} torch            {us:8.2f} us", flush=True)
        for chunk, warps, merge_warps in shapes:
            lp.CHUNK, lp.WARPS, lp.MERGE_WARPS = chunk, warps, merge_warps
            logprobs_cases.check(lp.row_logprobs_triton(logits, tokens, TOP), want, TOP, 2e-5)
            us = time_graph(lambda: lp.row_logprobs_triton(logits, tokens, TOP))[1]
            out["us_per_call"][f"kernel_{chunk}_{warps}_{merge_warps}_n{n}"] = round(us, 2)
            print(f"n={n:3d} kernel {chunk:5d} x{warps:<2d} merge x{merge_warps}  {us:8.2f} us",
                  flush=True)
        lp.CHUNK, lp.WARPS, lp.MERGE_WARPS = shapes[0]
        for count in (0, 1, 5):  # a graph's count: only the first of the top computed
            c = torch.tensor([count], dtype=torch.int32, device="cuda")
            us = time_graph(lambda: lp.row_logprobs_triton(logits, tokens, TOP, c))[1]
            out["us_per_call"][f"kernel_count{count}_n{n}"] = round(us, 2)
            print(f"n={n:3d} kernel count {count:2d}       {us:8.2f} us", flush=True)
        if n in (1, 24):
            for name, fn in (("torch", lambda: lp.row_logprobs_ref(logits, tokens, TOP)),
                             ("kernel", lambda: lp.row_logprobs_triton(logits, tokens, TOP))):
                table = kernel_table(fn)
                out["kernels"][f"{name}_n{n}"] = table
                for kname, count, t in table[:12]:
                    print(f"  {name} n={n}: {t:8.2f} us  x{count:<3d} {kname}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "diag_logprobs.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
