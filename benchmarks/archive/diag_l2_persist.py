"""Would pinning a draft head's LM head in L2 pay? A device experiment, no model.

    PYTHONPATH=$PWD python3 benchmarks/diag_l2_persist.py --out $OUT

An EAGLE-3 k = 2 step at batch 1 reads its draft LM head twice (two draft tokens, ~45 us apart)
and nothing else in the step is reused from one step to the next: 30 target layers stream
~100 MB of weights, so each step finds the LM head cold, and within a step the second read
finds part of the first's lines (run 21: 11.6 then 9.8 us for a 32000-id head). This times a
graph shaped like that step: 30 "layers" (one-row GEMVs over their own 3.4 MB), the target's
LM head (49152 x 576), then twice [the head's layer (5 MB of GEMVs), the draft LM head] with
the draft head's weight in an L2 access policy window marked persisting (cudaStreamSetAttribute
on the capture stream, cudaDeviceSetLimit for the persisting set-aside), against the same
graph without it; draft heads of 32000 and 49152 ids. EAGER=1 profiles the same kernels
launched on that stream without a graph. Writes $OUT/diag_l2_persist.json.

Run 22 (H200: 60 MB L2, 37.5 MB may persist): the window changed nothing, in the graph or
eagerly (the first draft read 12.6-13.1 us, the second 8.5-8.8, with or without it).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

DEV = "cuda"
H = 576


class _Window(ctypes.Structure):  # cudaAccessPolicyWindow
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t),
                ("hitRatio", ctypes.c_float), ("hitProp", ctypes.c_int),
                ("missProp", ctypes.c_int)]


class _Value(ctypes.Union):  # cudaStreamAttrValue (= cudaLaunchAttributeValue, 64 bytes)
    _fields_ = [("accessPolicyWindow", _Window), ("pad", ctypes.c_char * 64)]


def cudart():
    """The CUDA runtime torch loaded (the same instance), else one found beside torch."""
    torch.zeros(1, device=DEV)  # loads the runtime
    with open("/proc/self/maps") as f:
        loaded = sorted({line.split()[-1] for line in f if "libcudart.so" in line})
    if loaded:
        return ctypes.CDLL(loaded[0])
    roots = [os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(torch.__file__))]
    for root in roots:
        for pat in ("**/libcudart.so*",):
            hits = sorted(glob.glob(os.path.join(root, pat), recursive=True))
            if hits:
                return ctypes.CDLL(hits[-1])
    return ctypes.CDLL("libcudart.so")


def set_window(lib, stream: torch.cuda.Stream, t: torch.Tensor | None, hit_ratio=1.0):
    v = _Value()
    if t is not None:
        v.accessPolicyWindow = _Window(t.data_ptr(), t.numel() * t.element_size(), hit_ratio,
                                       2, 1)  # hit: persisting, miss: streaming
    else:
        v.accessPolicyWindow = _Window(None, 0, 0.0, 0, 0)
    rc = lib.cudaStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream), 1, ctypes.byref(v))
    return int(rc)


def step_weights(g):
    """-> (w(n): a random bf16 [n, H] weight, the 30 layers' stand-ins, the target's LM head,
    the head's layer, the one-row input)."""
    def w(n, k=H):
        return (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).bfloat16()

    layers = [w(6144) for _ in range(30)]  # a SmolLM2 layer's 3.5M weights (7.1 MB) each
    target_head = w(49152)
    head_layer = [w(1920), w(576), w(3072), w(1536)]  # EAGLE-3 qkv, o, gate_up, down sizes
    return w, layers, target_head, head_layer, torch.randn(1, H, device=DEV,
                                                           generator=g).bfloat16()


def step_fn(layers, target_head, head_layer, draft, x):
    """A step-shaped sequence: the target's layers and LM head, then twice [the head's layer,
    draft(x)] (draft: the draft LM head's product; diag_draft_lm_head.py varies it)."""
    def fn():
        h = x
        for w in layers:
            h = F.linear(x, w)[:, :H]
        F.linear(x, target_head)
        for _ in range(2):
            for w in head_layer:
                h = F.linear(x, w)[:, :H]
            draft(x)
        return h
    return fn


def time_graph(fn, stream, reps=200):
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1000 / reps, g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    args = ap.parse_args()
    lib = cudart()
    props = torch.cuda.get_device_properties(0)
    max_persist = ctypes.c_int()
    lib.cudaDeviceGetAttribute(ctypes.byref(max_persist), 108, 0)  # MaxPersistingL2CacheSize
    l2 = ctypes.c_int()
    lib.cudaDeviceGetAttribute(ctypes.byref(l2), 38, 0)  # L2CacheSize
    res = {"device": props.name, "l2_bytes": l2.value, "max_persisting_l2_bytes": max_persist.value}
    rc = lib.cudaDeviceSetLimit(6, ctypes.c_size_t(max_persist.value))  # PersistingL2CacheSize
    res["set_limit_rc"] = int(rc)
    g = torch.Generator(device=DEV).manual_seed(0)
    w, layers, target_head, head_layer, x = step_weights(g)
    rows = []
    for vocab in (32000, 49152):
        draft_head = w(vocab)
        for persist in (False, True, False):
            stream = torch.cuda.Stream()
            rc = set_window(lib, stream, draft_head if persist else None)
            fn = step_fn(layers, target_head, head_layer,
                         lambda x, w=draft_head: F.linear(x, w), x)
            us, graph = time_graph(fn, stream)
            # the draft LM heads alone, profiled in the graph
            from torch.profiler import ProfilerActivity, profile
            eager = os.environ.get("EAGER") == "1"  # launched on the stream, no graph
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    if eager:
                        with torch.cuda.stream(stream):
                            fn()
                    else:
                        graph.replay()
                torch.cuda.synchronize()
            ks = sorted((e for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA),
                        key=lambda e: e.time_range.start)
            durs = [e.time_range.end - e.time_range.start for e in ks]
            per = len(durs) // 5  # 30 layers, target head, 2 x (4 head GEMVs, draft head)
            mean = [sum(durs[r * per + i] for r in range(5)) / 5 for i in range(per)]
            rows.append({"draft_vocab": vocab, "persist": persist, "set_attr_rc": rc,
                         "graph_us": round(us, 1), "kernels_per_replay": per,
                         "target_head_us": round(mean[30], 2) if per == 41 else None,
                         "draft_heads_us": [round(mean[35], 2), round(mean[40], 2)]
                         if per == 41 else None,
                         "head_layer_us": round(sum(mean[31:35]) + sum(mean[36:40]), 2)
                         if per == 41 else None})
            print(rows[-1], flush=True)
            lib.cudaCtxResetPersistingL2Cache()
            del graph
    res["rows"] = rows
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "diag_l2_persist.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
