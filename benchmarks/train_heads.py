"""The shipped heads' recipe on one GPU: self-distill, train EAGLE-3 and MTP, evaluate, benchmark.

    python benchmarks/train_heads.py --gguf PATH --work DIR --out DIR --phases train
    python benchmarks/train_heads.py --gguf PATH --work DIR --out DIR --phases eval,bench

Phases (run in the background on the device machine and polled by benchmarks/poll_gpu.sh,
so that they may outlast one device call of 10 minutes):
  train   the target answers --prompts (default data/sharegpt_prompts.jsonl): greedy, then
          --samples sampled answers each when the greedy ones were quick enough (a skip is
          logged); cached in WORK; then `train_draft` for
          EAGLE-3 and for MTP (one module), each under its time budget, on answers cut
          --loop-tokens tokens after they start to loop. The heads (with their
          checkpoints and training.json) stay in WORK.
  eval    `eval_draft` of both heads (WORK's, else the ones shipped for the target): chain
          acceptance per position and mean acceptance length
          for k = 1..7 on MT-bench and HumanEval (greedy, bf16, the engine's verify).
  profile where an EAGLE-3 training step's time goes, eager and compiled (torch.profiler,
          --profile-steps, --profile-prompts)
  bench   tok/s side by side in one process (WORK's heads, else the shipped ones): no
          speculation, EAGLE-3 k = 1..5, MTP k = 1..3
          (trained heads, real acceptance), and EAGLE-3 k = 2 under force-accept 3 (synthetic),
          at batch 1, 32 and 128 on MT-bench prompts, 128 new tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import traceback
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import device_name, git_commit  # noqa: E402

DATA = ROOT / "data" / "sharegpt_prompts.jsonl"
PROMPTS = ROOT / "benchmarks" / "prompts"
T0 = time.monotonic()


def left(args) -> float:
    return args.deadline_s - (time.monotonic() - T0)


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def phase_train(args, loaded) -> dict:
    from outpace.training.config import TrainConfig
    from outpace.training.selfdistill import read_prompts, regenerate
    from outpace.training.trainer import Trainer
    work = Path(args.work)
    cache = work / "selfdistill.jsonl"
    prompts = read_prompts(args.prompts, limit=args.max_prompts)
    t = time.monotonic()
    regenerate(args.gguf, prompts, cache, loaded=loaded, device=args.device,
               max_tokens=args.answer_tokens, samples=0, seed=args.seed,
               temperature=args.temperature)
    greedy_s = time.monotonic() - t
    log(f"greedy answers: {greedy_s:.0f} s")
    samples = 0
    if args.samples and greedy_s < args.max_regen_s / (1 + args.samples):
        t = time.monotonic()
        regenerate(args.gguf, prompts, cache, loaded=loaded, device=args.device,
                   max_tokens=args.answer_tokens, samples=args.samples, seed=args.seed,
                   temperature=args.temperature)
        samples = args.samples
        log(f"sampled answers: {time.monotonic() - t:.0f} s")
    elif args.samples:
        log(f"sampled answers SKIPPED: the greedy ones took {greedy_s:.0f} s, over "
            f"--max-regen-s / (1 + --samples) = {args.max_regen_s / (1 + args.samples):.0f} s; "
            f"pass a larger --max-regen-s to have them")
    if args.keep_answers:  # the answers come back too (gzip), to study or to carry later
        import gzip
        with open(cache, "rb") as src, gzip.open(Path(args.out) / "selfdistill.jsonl.gz",
                                                 "wb") as dst:
            shutil.copyfileobj(src, dst)
    empty_cache()
    report = {"greedy_s": round(greedy_s, 1), "samples": samples,
              "samples_skipped": bool(args.samples) and not samples}
    plans = {"eagle3": (args.eagle_minutes, dict(draft_vocab=args.draft_vocab, lr=args.lr_eagle,
                                                 batch_tokens=args.batch_tokens)),
             "mtp": (args.mtp_minutes, dict(lr=args.lr_mtp,
                                            batch_tokens=args.batch_tokens // 2))}
    runs = []  # (method, folder name, extra options)
    for method in args.heads:
        if method == "eagle3" and len(args.aux_layers) > 1:
            runs += [(method, "eagle3-" + "-".join(map(str, a)), {"aux_layers": a})
                     for a in args.aux_layers]
        elif method == "eagle3" and args.aux_layers:
            runs.append((method, method, {"aux_layers": args.aux_layers[0]}))
        else:
            runs.append((method, method, {}))
    for method, name, variant in runs:
        minutes, extra = plans[method]
        extra = dict(extra, **variant)
        t = time.monotonic()
        trainer = None
        try:
            cfg = TrainConfig(method=method, target=args.gguf, data=str(args.prompts),
                              out=str(work / name), data_cache=str(cache), samples=samples,
                              answer_tokens=args.answer_tokens, holdout=args.holdout,
                              temperature=args.temperature, loop_tokens=args.loop_tokens,
                              epochs=args.epochs, max_minutes=minutes, save_every=200,
                              seed=args.seed,
                              warmup=0.01, max_prompts=args.max_prompts, device=args.device,
                              resume=str(work / name) if args.resume else None,
                              compile=args.compile, init_head=init_head(args, method),
                              extra_answers=tuple(args.extra_answers),
                              **extra)
            trainer = Trainer(cfg, loaded=loaded)
            head_dir = trainer.run()
        except Exception:  # the other head and the later phases still run
            traceback.print_exc()
            report[name] = {"error": traceback.format_exc(limit=3)}
            continue
        finally:
            trainer = None
            empty_cache()
        info = json.loads((head_dir / "training.json").read_text())
        report[name] = {k: info[k] for k in ("steps", "planned_steps", "train_seconds",
                                             "sequences", "answer_tokens",
                                             "draft_vocab_coverage", "coverage_by_size",
                                             "holdout") if k in info}
        report[name]["wall_s"] = round(time.monotonic() - t, 1)
        if name != method:  # a variant: its acceptance decides which one the later phases use
            report[name]["mtbench"] = quick_eval(args, loaded, method, head_dir)
        log(f"{name}: {report[name]}")
        if name == method:
            export(args, method, head_dir)
    variants = {n: r["mtbench"]["mean_acceptance_length"] for n, r in report.items()
                if isinstance(r, dict) and "mtbench" in r}
    if variants:
        best = max(variants, key=variants.get)
        log(f"variants (MT-bench mean acceptance length at k = {args.variant_k}): {variants}; "
            f"{best} goes on as {work / 'eagle3'}")
        shutil.rmtree(work / "eagle3", ignore_errors=True)
        shutil.copytree(work / best, work / "eagle3")
        export(args, "eagle3", work / "eagle3")
        report["variant_choice"] = {"k": args.variant_k, "mean_acceptance_length": variants,
                                    "chosen": best}
    return report


def init_head(args, method: str):
    """--init-from: None (a new head), "shipped" (the head shipped for the target) or a folder
    holding one folder per method."""
    if args.init_from is None:  # (kept on --resume: it is part of the run's trajectory)
        return None
    if args.init_from == "shipped":
        from outpace.models.shipped_heads import shipped_head
        found = shipped_head(args.gguf, method)
        if found is None:
            raise SystemExit(f"--init-from shipped: no {method} head is shipped for {args.gguf}")
        return str(found)
    return str(Path(args.init_from) / method)


def export(args, method: str, head: Path) -> None:
    """The head's files into OUT/<method> (they come back from the device machine)."""
    dest = Path(args.out) / method
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "model.safetensors", "training.json"):
        shutil.copy(head / f, dest / f)


def quick_eval(args, loaded, method: str, head: Path) -> dict:
    """Mean acceptance length at k = --variant-k on the first --variant-prompts MT-bench
    prompts: what ranks the variants."""
    from outpace.training.evaluate import eval_draft
    res = eval_draft(method, str(head), args.gguf, {"mtbench": PROMPTS / "mtbench.jsonl"},
                     ks=[args.variant_k], max_tokens=args.eval_tokens, device=args.device,
                     max_prompts=args.variant_prompts, max_num_seqs=128, loaded=loaded,
                     quiet=True)
    empty_cache()
    return res["sets"]["mtbench"][str(args.variant_k)]


def phase_profile(args, loaded) -> dict:
    """Where an EAGLE-3 training step's time goes, eager and under --compile: per variant,
    --profile-steps steps after as many warm-up steps (the compile's included), the mean wall
    time of a step with and without torch.profiler, and the kernel table in
    OUT/profile_eagle3.txt. Both variants train the same batches from the same start. The
    answers are greedy ones to the first --profile-prompts prompts, cached in WORK/profile."""
    from outpace.training.config import TrainConfig
    from outpace.training.selfdistill import read_prompts, regenerate
    from outpace.training.trainer import Trainer
    work = Path(args.work) / "profile"
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "answers.jsonl"
    prompts = read_prompts(args.prompts, limit=args.profile_prompts)
    regenerate(args.gguf, prompts, cache, loaded=loaded, device=args.device,
               max_tokens=args.answer_tokens, samples=0, seed=0, temperature=args.temperature)
    n = args.profile_steps
    report, tables = {}, []
    for compiled in (False, True):
        name = "compiled" if compiled else "eager"
        cfg = TrainConfig(method="eagle3", target=args.gguf, data=str(args.prompts),
                          out=str(work / name), data_cache=str(cache), samples=0,
                          answer_tokens=args.answer_tokens, holdout=0,
                          temperature=args.temperature, loop_tokens=args.loop_tokens, epochs=1,
                          max_prompts=args.profile_prompts, device=args.device,
                          draft_vocab=args.draft_vocab, lr=args.lr_eagle,
                          batch_tokens=args.batch_tokens, compile=compiled, quiet=True)
        try:
            trainer = Trainer(cfg, loaded=loaded)

            def timed() -> tuple:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                t, losses = time.perf_counter(), []
                for _ in range(n):
                    losses.append(trainer.train_step()["loss"])
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                return (time.perf_counter() - t) / n, losses

            t = time.perf_counter()
            warm, warm_losses = timed()  # warm-up (and the compile)
            warm_s = time.perf_counter() - t
            plain, losses = timed()
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=acts) as prof:
                profiled, _ = timed()
            key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
            tables.append(f"== {name}: {n} steps of {args.batch_tokens} tokens: "
                          f"{plain * 1e3:.1f} ms a step ({profiled * 1e3:.1f} under the "
                          f"profiler)\n\n"
                          + prof.key_averages().table(sort_by=key, row_limit=50))
            report[name] = {"step_ms": round(plain * 1e3, 2),
                            "profiled_step_ms": round(profiled * 1e3, 2),
                            "warmup_s": round(warm_s, 1),
                            "losses": warm_losses + losses}
        except Exception:  # the other variant still runs
            traceback.print_exc()
            report[name] = {"error": traceback.format_exc(limit=3)}
        trainer = None
        empty_cache()
        log(f"profile {name}: {report[name].get('step_ms')} ms a step")
        (Path(args.out) / "profile_eagle3.txt").write_text("\n\n".join(tables) + "\n")
    report["steps"] = n
    return report


def head_dir(args, method: str):
    """WORK/<method> when this recipe trained one there, else the head shipped for the target
    (or None)."""
    from outpace.models.shipped_heads import shipped_head
    own = Path(args.work) / method
    return own if (own / "config.json").is_file() else shipped_head(args.gguf, method)


def phase_eval(args, loaded) -> dict:
    from outpace.training.evaluate import eval_draft
    out = {}
    for method in args.heads:
        head = head_dir(args, method)
        if head is None:
            continue
        res = eval_draft(method, str(head), args.gguf,
                         {"mtbench": PROMPTS / "mtbench.jsonl",
                          "humaneval": PROMPTS / "humaneval.jsonl"},
                         ks=args.eval_ks, max_tokens=args.eval_tokens, device=args.device,
                         max_prompts=args.eval_prompts,
                         max_num_seqs=128, loaded=loaded, quiet=False,
                         out_json=Path(args.out) / f"eval_{method}.json")
        out[method] = res
        log(f"eval {method} done")
    return out


def _run(engine, prompts, batch, max_tokens) -> dict:
    """`batch` requests at a time over `prompts`, greedy, to EOS or max_tokens -> tok/s."""
    from outpace import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, output_kind="final_only")
    spec0 = dict(engine.stats()["spec"])
    n_tok, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        for j, p in enumerate(prompts[i:i + batch]):
            engine.add_request(f"b{i}-{j}-{time.monotonic_ns()}", p, sp)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    n_tok += len(o.token_ids)
    wall = time.perf_counter() - t0
    s1 = engine.stats()["spec"]
    drafts = s1["num_drafts"] - spec0["num_drafts"]
    acc = s1["num_accepted_tokens"] - spec0["num_accepted_tokens"]
    return {"tokens": n_tok, "wall_s": round(wall, 4), "tok_s": round(n_tok / wall, 1),
            "mean_acceptance_length": round(1 + acc / drafts, 3) if drafts else None}


def phase_bench(args, loaded) -> dict:
    from outpace.engine.engine import LLMEngine
    from outpace.training.selfdistill import prompt_ids, read_prompts
    tok = loaded[2]
    mt = [prompt_ids(tok, p["prompt"]) for p in read_prompts(PROMPTS / "mtbench.jsonl")]
    # batch 32 and 128 run several waves (the prompts repeat, prefix caching off): one or two
    # waves last well under a second, within the spread between processes
    sets = {1: mt[:args.b1_requests], 32: (mt * 4)[:256], 128: (mt * 5)[:384]}
    sets = {b: ps for b, ps in sets.items() if b in args.batches}
    heads = {m: head_dir(args, m) for m in ("eagle3", "mtp")}
    configs = [("no-spec", None)]
    for k in args.eagle_ks:
        configs.append((f"eagle3-k{k}", {"method": "eagle3", "model": str(heads["eagle3"]),
                                         "num_speculative_tokens": k}))
    for k in args.cost_ks:  # the draft-length cost model, each request's k in 0..K
        configs.append((f"eagle3-cost-k{k}", {"method": "eagle3", "model": str(heads["eagle3"]),
                                              "num_speculative_tokens": k, "adaptive": "cost"}))
    for k in args.mtp_ks:
        configs.append((f"mtp-k{k}", {"method": "mtp", "model": str(heads["mtp"]),
                                      "num_speculative_tokens": k}))
    configs.append(("eagle3-k2-force-accept3 (synthetic)",
                    {"method": "eagle3", "model": str(heads["eagle3"]),
                     "num_speculative_tokens": 2, "force_accept_mean": 3.0}))
    configs = [(n, c) for n, c in configs if c is None or heads[c["method"]] is not None]
    # process warm-up (lazy CUDA module loading, first kernel selections)
    eng = LLMEngine.from_args(args.gguf, loaded=loaded, device=args.device, dtype=args.dtype,
                              max_num_seqs=128, num_kv_blocks=args.kv_blocks,
                              enable_prefix_caching=False, quiet=True)
    for b, ps in sets.items():
        _run(eng, ps[:max(b, 1)], b, 16)
    del eng
    rows, tables = [], {}
    for name, spec in configs:
        if left(args) < 25:
            log(f"bench: out of time before {name}")
            break
        eng = LLMEngine.from_args(args.gguf, loaded=loaded, device=args.device, dtype=args.dtype,
                                  speculative_config=spec, max_num_seqs=128,
                                  num_kv_blocks=args.kv_blocks, enable_prefix_caching=False,
                                  quiet=True)
        for b, ps in sets.items():
            _run(eng, ps[:b], b, 8 if b < 128 else args.bench_tokens)  # warm-up
        table = step_time_table(eng)
        if table:
            tables[name] = table
        for b, ps in sets.items():
            runs = sorted((_run(eng, ps, b, args.bench_tokens) for _ in range(args.reps)),
                          key=lambda r: r["tok_s"])
            r = dict(runs[len(runs) // 2], config=name, batch=b,
                     tok_s_runs=[x["tok_s"] for x in runs])
            rows.append(r)
            log(f"bench {name} b{b}: {r['tok_s']} tok/s, tau {r['mean_acceptance_length']}")
        del eng
        empty_cache()
    base = {r["batch"]: r["tok_s"] for r in rows if r["config"] == "no-spec"}
    for r in rows:
        r["vs_no_spec"] = round(r["tok_s"] / base[r["batch"]], 3) if r["batch"] in base else None
    return {"rows": rows, "max_tokens": args.bench_tokens, "reps": args.reps,
            "b1_requests": args.b1_requests, "step_times": tables}


def step_time_table(engine) -> dict:
    """The cost model's step-time table of an engine that has one (`"adaptive": "cost"`), in
    microseconds: verify[bucket][q], draft[bucket][m], per_draft[k]; {} otherwise."""
    proposer = engine.runner.proposer
    model = proposer.policy.cost_model if proposer is not None else None
    table = getattr(model, "table", None)
    if table is None:
        return {}
    us = lambda t: round(t * 1e6, 1)  # noqa: E731
    out = {"verify": {}, "draft": {}, "per_draft": [us(t) for t in table.per_draft]}
    for (b, q), t in sorted(table.verify.items()):
        out["verify"].setdefault(str(b), {})[str(q)] = us(t)
    for (b, m), t in sorted(table.draft.items()):
        out["draft"].setdefault(str(b), {})[str(m)] = us(t)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--work", required=True, help="heads, checkpoints and answers (kept)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default="train")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=Path, default=DATA,
                    help="the training prompts (JSONL; default data/sharegpt_prompts.jsonl; "
                    "benchmarks/sharegpt_prompts.py makes a larger one)")
    ap.add_argument("--max-prompts", type=int, default=None,
                    help="the first N of --prompts (CPU smoke runs, or a share of a large file)")
    ap.add_argument("--heads", default="eagle3,mtp")
    ap.add_argument("--deadline-s", type=float, default=1000,
                    help="the bench phase stops starting configurations this late")
    ap.add_argument("--answer-tokens", type=int, default=384)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.8, help="of the sampled answers")
    ap.add_argument("--seed", type=int, default=0,
                    help="the sampled answers and the data order (another seed: other answers)")
    ap.add_argument("--loop-tokens", type=int, default=64,
                    help="answer tokens kept once an answer loops (-1: all)")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--epochs", type=float, default=30.0,
                    help="planned epochs (the time budget decides how many steps run)")
    ap.add_argument("--eagle-minutes", type=float, default=8.0)
    ap.add_argument("--mtp-minutes", type=float, default=2.5)
    ap.add_argument("--max-regen-s", type=float, default=330,
                    help="sampled answers only when greedy and sampled fit this")
    ap.add_argument("--lr-eagle", type=float, default=8e-4)
    ap.add_argument("--lr-mtp", type=float, default=5e-4)
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--holdout", type=int, default=100)
    ap.add_argument("--eval-tokens", type=int, default=256)
    ap.add_argument("--eval-ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7])
    ap.add_argument("--eval-prompts", type=int, default=None, help="first N of each set")
    ap.add_argument("--bench-tokens", type=int, default=128)
    ap.add_argument("--b1-requests", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--kv-blocks", type=int, default=8192)
    ap.add_argument("--resume", action="store_true",
                    help="continue the heads in WORK (pass other --epochs for a new schedule)")
    ap.add_argument("--extra-answers", nargs="+", default=(), metavar="FILE",
                    help="earlier runs' answer caches (--keep-answers' files, other seeds): "
                         "their sampled answers join the training data")
    ap.add_argument("--keep-answers", action="store_true",
                    help="write the self-distilled answers into OUT (gzip)")
    ap.add_argument("--aux-layers", nargs="+", default=[],
                    help="EAGLE-3 aux layer sets, each I,J,K; with more than one, each trains "
                         "under the same budget, the best by MT-bench acceptance goes on")
    ap.add_argument("--profile-steps", type=int, default=10,
                    help="profile phase: steps timed (after as many warm-up steps)")
    ap.add_argument("--profile-prompts", type=int, default=1000,
                    help="profile phase: the first N training prompts answered (greedy)")
    ap.add_argument("--compile", action="store_true",
                    help="train with torch.compile (TrainConfig.compile)")
    ap.add_argument("--init-from", default=None,
                    help="start each head from a trained one: 'shipped' or a folder with "
                         "eagle3/ and mtp/ inside")
    ap.add_argument("--variant-k", type=int, default=5)
    ap.add_argument("--variant-prompts", type=int, default=80)
    ap.add_argument("--eagle-ks", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--mtp-ks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--cost-ks", type=int, nargs="*", default=[],
                    help="bench EAGLE-3 with the draft-length cost model (adaptive='cost') up to "
                         "each K; its step-time table goes into the JSON")
    args = ap.parse_args()
    args.heads = args.heads.split(",")
    args.aux_layers = [tuple(int(i) for i in a.split(",")) for a in args.aux_layers]
    if args.resume and len(args.aux_layers) > 1:
        ap.error("--resume continues one head: pass one --aux-layers set (the head's)")
    if args.loop_tokens < 0:
        args.loop_tokens = None
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    from outpace.models.loader import load_model
    args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    loaded = load_model(args.gguf, dtype=getattr(torch, args.dtype),
                        device=torch.device(args.device), quiet=True)
    result = {"commit": git_commit(), "device": device_name(args.device), "torch": torch.__version__,
              "time": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args)}
    phases = {"train": phase_train, "eval": phase_eval, "bench": phase_bench,
              "profile": phase_profile}
    for name in args.phases.split(","):
        log(f"phase {name}")
        result[name] = phases[name](args, loaded)
        tag = "_".join(args.phases.split(","))
        (Path(args.out) / f"heads_{tag}.json").write_text(
            json.dumps(result, indent=1, default=str) + "\n")  # args' paths as text
    log("done")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
