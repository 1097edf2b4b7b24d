"""Every speculative method against no speculation, in turns: issue 35's table.

    python benchmarks/methods.py --gguf MODEL.gguf --out out [--batches 1 8 32 128] [--rounds 3]

Each method runs at its defaults (k = 3, the heads shipped for the default model; on CUDA
n-gram and suffix draft up to 16 requests a step) and with the draft-length cost model
(`"adaptive": "cost"`), the model-free drafters also at every batch size (`-every`) and, with
--copy-k N (N > k), N drafts for a request alone in its batch and k up to 16 (`-schedN`), n-gram
also with its lookup on the host (`"ngram_device": false`; its default on CUDA is the lookup in
the graphs); greedy, 128 new tokens (EOS ignored; the copy set: below), bf16 on CUDA (--device
cpu: fp32, a smoke run). Three prompt sets:
  chat  MT-bench first turns (batch 1: the first 16 one at a time; batch 8: the 80 in waves of
        8; batch 32: the 80 x 4; batch 128: the 80 x 5)
  chat1 the chat set's batch 1 alone (--depths: MTP with a random 3-module head, eagle and
        depths mode at force-accept 3, issue 35's synthetic comparison)
  copy  a copy-heavy set, batch 1 only: each of the first 16 HumanEval prompts with "rewrite
        this with type hints and a docstring" (the answer repeats most of the prompt), each to
        its EOS or --copy-max-tokens (past its EOS the model starts a conversation of its own,
        which is no longer a copy); --copy-k 8: also n-gram on the device and suffix drafting
        up to 8 tokens there (and on chat1)
All engines are built first, then timed in turns, round by round, the order rotating, so that
the host's slow and fast periods fall on every engine alike; per (set, batch, config) the
median tok/s over the rounds and the median of its ratio to no-spec's run of the same round.
Writes gpu_methods.json in --out after every round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    chat_ids, device_name, drop_script_folder, git_commit, load_prompts, print_table, run_engine,
    write_result)

COPY_INSTRUCTION = ("Rewrite this Python code with type hints and a docstring. Keep the code "
                    "and its comments as they are.\n\n```python\n{code}```")


NGRAM_REF = "ngram-device-ref"  # built with KernelOptions' ngram_lookup_kernel off
EVERY = 1 << 16  # a k_schedule bound above any batch: drafting at every batch size


def configs(k: int, heads: dict, depths_head=None, copy_ks=(), ngram_ref=False) -> list:
    """(name, speculative_config or None, prompt sets) of the run. depths_head: a random
    3-module MTP head, for the depths-mode rows (synthetic: force-accept 3, chat batch 1).
    copy_ks: longer drafts for the model-free drafters on the copy-heavy set (`-kN` rows): a
    copied span is accepted whole, so k bounds what a step can emit there."""
    out = [("no-spec", None, ("chat", "copy"))]
    for ck in copy_ks:  # (and on chat prompts at batch 1: what the longer drafts cost there)
        out.append((f"ngram-device-k{ck}", {"method": "ngram", "num_speculative_tokens": ck,
                                            "ngram_device": True}, ("chat1", "copy")))
        out.append((f"suffix-k{ck}", {"method": "suffix", "num_speculative_tokens": ck},
                    ("chat1", "copy")))
    if depths_head is not None:  # issue 35: depths mode within 10% of MTP-Eagle's tok/s
        for mode in ("eagle", "depths"):
            out.append((f"mtp3-{mode}-fa3 (synthetic)",
                        {"method": "mtp", "model": str(depths_head), "num_speculative_tokens": 3,
                         "mtp_mode": mode, "force_accept_mean": 3.0}, ("chat1",)))
    for method in ("ngram", "suffix", "eagle3", "mtp"):
        base = {"method": method, "num_speculative_tokens": k}
        if method in heads:
            base["model"] = str(heads[method])
        elif method in ("eagle3", "mtp"):
            continue
        sets = ("chat", "copy") if method != "mtp" else ("chat",)
        out.append((method, base, sets))
        out.append((f"{method}-cost", {**base, "adaptive": "cost"}, ("chat",)))
        if method in ("ngram", "suffix"):  # (on CUDA their default drafts up to 16 requests
            # a step): drafting at every batch size, and longer drafts alone in the batch
            out.append((f"{method}-every", {**base, "k_schedule": [[EVERY, k]]}, ("chat",)))
            for ck in (c for c in copy_ks if c > k):
                out.append((f"{method}-sched{ck}", {**base, "num_speculative_tokens": ck,
                                                    "k_schedule": [[1, ck], [16, k]]},
                            ("chat", "copy")))
        if method == "ngram":  # the lookup on the host, after each step's copy
            out.append(("ngram-host", {**base, "ngram_device": False}, ("chat", "copy")))
            if ngram_ref:  # the same with the lookup's tensor-op reference, not its kernel
                out.append((NGRAM_REF, {**base, "ngram_device": True}, ("chat", "copy")))
    if "eagle3" in heads:  # the suffix enhancer over the head's drafts
        out.append(("eagle3-enhancer", {"method": "eagle3", "model": str(heads["eagle3"]),
                                        "num_speculative_tokens": k, "enhancer_min_match": 4},
                    ("copy",)))
    return out


def engine_options(name: str) -> dict:
    """A config's engine arguments beside its speculative_config."""
    if name == NGRAM_REF:
        from outpace.runner_config import KernelOptions
        return {"kernel_options": KernelOptions().ablate("ngram_lookup_kernel")}
    return {}


def prompt_sets(tok, batches) -> dict:
    mt = chat_ids(tok, load_prompts("mtbench", 80))
    copy = chat_ids(tok, [COPY_INSTRUCTION.format(code=p) for p in load_prompts("humaneval", 16)])
    chat = {1: mt[:16], 8: mt, 32: mt * 4, 128: mt * 5}
    return {"chat": {b: chat.get(b, mt) for b in batches}, "copy": {1: copy},
            "chat1": {1: mt[:16]}}


def main():
    drop_script_folder()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (fp32)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128,
                    help="new tokens a request (EOS ignored) on the chat sets")
    ap.add_argument("--copy-max-tokens", type=int, default=256,
                    help="new tokens a request at most on the copy set (which stops at EOS)")
    ap.add_argument("--kv-blocks", type=int, default=4096)
    ap.add_argument("--configs", default="", help="only these (comma-separated names)")
    ap.add_argument("--depths", action="store_true",
                    help="also MTP with a random 3-module head, eagle and depths mode, under "
                    "force-accept 3 at batch 1 (synthetic rows)")
    ap.add_argument("--copy-k", type=int, nargs="*", default=[],
                    help="also n-gram on the device and suffix at these k on the copy-heavy set")
    ap.add_argument("--ngram-ref", action="store_true",
                    help=f"also {NGRAM_REF}: n-gram on the device with the lookup's tensor-op "
                    "reference instead of its Triton kernel")
    ap.add_argument("--deadline-s", type=float, default=540,
                    help="no round starts later than this after the start")
    args = ap.parse_args()
    t0 = time.perf_counter()
    from outpace.engine.engine import LLMEngine
    from outpace.models.loader import load_model
    from outpace.models.shipped_heads import shipped_head
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    loaded = load_model(args.gguf, dtype=dtype, device=torch.device(args.device), quiet=True)
    heads = {m: shipped_head(args.gguf, m) for m in ("eagle3", "mtp")}
    heads = {m: h for m, h in heads.items() if h is not None}
    sets = prompt_sets(loaded[2], args.batches)
    depths_head = None
    if args.depths:
        import tempfile
        from outpace.training.init_draft import init_draft
        depths_head = init_draft("mtp", args.gguf, Path(tempfile.mkdtemp()) / "mtp3",
                                 num_layers=3, quiet=True)
    todo = configs(args.k, heads, depths_head, args.copy_k, args.ngram_ref)
    if args.configs:
        todo = [c for c in todo if c[0] in args.configs.split(",")]
    out_path = Path(args.out)
    out_path = out_path if out_path.suffix == ".json" else out_path / "gpu_methods.json"
    result = {"commit": git_commit(), "device": device_name(args.device),
              "torch": torch.__version__,
              "args": vars(args), "heads": {m: str(h) for m, h in heads.items()}, "build_s": {},
              "runs": {}}
    engines = []
    for name, spec, wanted in todo:
        tb = time.perf_counter()
        eng = LLMEngine.from_args(args.gguf, loaded=loaded, device=args.device,
                                  dtype=str(dtype).removeprefix("torch."),
                                  speculative_config=spec, max_num_seqs=max(args.batches),
                                  num_kv_blocks=args.kv_blocks, enable_prefix_caching=False,
                                  quiet=True, **engine_options(name))
        for s in wanted:  # warm-up: a full-length wave at every batch size, so that most
            # graphs captured on first launch (a batch draining through smaller buckets, the
            # cost model's other lengths: they depend on its state) are captured before timing
            for b, ps in sets[s].items():
                run_engine(eng, ps[:b], b, **lengths(s, args))
        result["build_s"][name] = round(time.perf_counter() - tb, 1)
        cost = cost_model_of(eng)
        if cost is not None and cost.table is not None:  # the start-up table it weighs (ms):
            # "bucket/q" is a step's verify time at query length q (drafts + 1)
            result.setdefault("cost_tables", {})[name] = {
                f"{b}/q{q}": round(t * 1e3, 4) for (b, q), t in sorted(cost.table.verify.items())}
        print(f"[{time.perf_counter() - t0:6.1f}s] built {name}", flush=True)
        engines.append((name, eng, wanted))
    runs = result["runs"]
    for rnd in range(args.rounds):
        if rnd and time.perf_counter() - t0 > args.deadline_s:
            print(f"deadline: {rnd} rounds", flush=True)
            break
        shift = rnd % len(engines)
        for name, eng, wanted in engines[shift:] + engines[:shift]:
            for s in wanted:
                for b, ps in sets[s].items():
                    fused = eng.runner.fused
                    before = ((fused.chained, fused.replays, fused.table.captures)
                              if fused is not None else (0, 0, 0))
                    paths0 = dict(eng.runner.path_steps)
                    cost = cost_model_of(eng)
                    measured = cost.measured if cost is not None else None
                    samples0 = measured.sample_counts() if measured is not None else {}
                    r = run_engine(eng, ps, b, **lengths(s, args))
                    row = {k: r[k] for k in ("tok_s", "mean_acceptance_length",
                                             "acceptance_per_position")}
                    if fused is not None and fused.replays > before[1]:
                        row["chained_share"] = round((fused.chained - before[0]) /
                                                     (fused.replays - before[1]), 3)
                    # the run's steps launched from the host, by path (chained fused steps and
                    # overlapped launches are not counted here)
                    row["paths"] = {k: v - paths0.get(k, 0) for k, v in
                                    eng.runner.path_steps.items() if v - paths0.get(k, 0)}
                    if fused is not None:  # graphs first launched inside the timed run
                        row["captures"] = fused.table.captures - before[2]
                    if measured is not None:
                        # the measured corrections to its table (ms) after this run, and the
                        # intervals this run measured per "bucket/drafts"
                        row["measured_ms"] = measured.snapshot()
                        row["measured_samples"] = {
                            k: n - samples0.get(k, 0) for k, n in measured.sample_counts().items()
                            if n > samples0.get(k, 0)}
                    runs.setdefault(f"{s}/b{b}/{name}", []).append(row)
        print(f"[{time.perf_counter() - t0:6.1f}s] round {rnd} done", flush=True)
        result["table"] = table(runs)
        write_result(out_path, result)
    print_table(result["table"], ["set", "batch", "config", "tok_s", "vs_no_spec",
                                  "mean_acceptance_length"])
    print("wrote", out_path)


def lengths(prompt_set: str, args) -> dict:
    """run_engine's output length for a prompt set: the chat sets a fixed number of tokens
    (EOS ignored), the copy set each answer to its EOS."""
    if prompt_set == "copy":
        return {"max_tokens": args.copy_max_tokens, "ignore_eos": False}
    return {"max_tokens": args.max_tokens}


def cost_model_of(engine):
    proposer = engine.runner.proposer
    return proposer.policy.cost_model if proposer is not None else None


def table(runs: dict) -> list:
    med = statistics.median
    rows = []
    for key, rs in runs.items():
        s, b, name = key.split("/")
        base = runs.get(f"{'chat' if s == 'chat1' else s}/{b}/no-spec", [])
        ratios = [r["tok_s"] / x["tok_s"] for r, x in zip(rs, base)]
        mal = [r["mean_acceptance_length"] for r in rs if r["mean_acceptance_length"]]
        rows.append({"set": s, "batch": int(b[1:]), "config": name,
                     "tok_s": round(med(r["tok_s"] for r in rs), 1),
                     "tok_s_runs": [r["tok_s"] for r in rs],
                     "vs_no_spec": round(med(ratios), 3) if ratios else None,
                     "mean_acceptance_length": round(med(mal), 3) if mal else None,
                     "acceptance_per_position": rs[-1]["acceptance_per_position"]})
    return sorted(rows, key=lambda r: (r["set"], r["batch"], r["config"] != "no-spec"))


if __name__ == "__main__":
    main()
