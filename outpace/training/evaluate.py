"""`outpace eval-draft`: a draft head's acceptance, measured through the engine itself.

For each k, one engine with the head (greedy, chain drafts, the real verify path) runs every
prompt of each set; the engine's counters give, per set and k:

    mean_acceptance_length    tokens per verify step, bonus included (1 + accepted / drafts)
    acceptance_per_position   chain acceptance: the share of verify steps whose draft j was
                              accepted (and so every draft before it)

written as JSON and, where matplotlib is installed, a PNG (acceptance per position, one line a
k, one panel a prompt set). The lines per k and set on stderr are progress (`quiet` drops them);
`result_table` is the result as the CLI prints it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from outpace.errors import ConfigError
from outpace.runner_config import resolve_device
from outpace.training.selfdistill import prompt_ids, read_prompts


def _spec_delta(before: dict, after: dict) -> tuple:
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    old = before["accepted_per_position"]
    per = [a - (old[i] if i < len(old) else 0) for i, a in enumerate(after["accepted_per_position"])]
    return drafts, accepted, per


def eval_draft(method: str, draft: Optional[str], target: str, prompt_sets: dict,
               ks=(1, 2, 3, 4, 5, 6, 7), max_tokens: int = 256, max_prompts: Optional[int] = None,
               device: str = "auto", dtype: str = "auto", max_num_seqs: int = 64,
               out_json=None, out_png=None, quiet: bool = False, loaded=None,
               spec_options: Optional[dict] = None) -> dict:
    """prompt_sets: {name: JSONL path}. draft None: the shipped head for the target.
    -> {"sets": {name: {k: {...}}}, ...}, also written to out_json (and out_png)."""
    from outpace.engine.engine import LLMEngine
    from outpace.models.loader import load_model
    from outpace.types import SamplingParams
    if method not in ("eagle3", "mtp"):
        raise ConfigError(f"eval-draft measures EAGLE-3 and MTP heads; --method {method!r} is "
                          f"neither")
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1 or ks[-1] > 16:
        raise ConfigError(f"--k values must be in 1..16, got {ks}")
    device = resolve_device(device)
    sets = {name: read_prompts(path, limit=max_prompts) for name, path in prompt_sets.items()}
    if loaded is None:
        from outpace.runner_config import RunnerConfig
        rc = RunnerConfig(device=device, dtype=dtype)
        loaded = load_model(target, dtype=rc.torch_dtype, device=torch.device(device),
                            quiet=quiet)
    tok = loaded[2]
    ids = {name: [prompt_ids(tok, p["prompt"]) for p in ps] for name, ps in sets.items()}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, output_kind="final_only")
    from outpace.models.draft_weights import draft_weights
    from outpace.runner_config import RunnerConfig
    # the dtype the drafts' matrices were read in (bf16 copies on a CPU that has them)
    weights = draft_weights((spec_options or {}).get("draft_weight_dtype", "auto"),
                            RunnerConfig(device=device, dtype=dtype))
    result = {"method": method, "draft": draft, "target": target, "device": device,
              "dtype": dtype, "max_tokens": max_tokens, "ks": ks,
              "draft_weights": str(weights.cpu_copies or weights.stored).removeprefix("torch."),
              "prompts": {n: len(v) for n, v in ids.items()}, "sets": {n: {} for n in ids}}
    for k in ks:
        spec = {"method": method, "num_speculative_tokens": k, **(spec_options or {})}
        if draft is not None:
            spec["model"] = str(draft)
        engine = LLMEngine.from_args(target, loaded=loaded, device=device, dtype=dtype,
                                     speculative_config=spec, max_num_seqs=max_num_seqs,
                                     quiet=True)
        for name, prompts in ids.items():
            before = dict(engine.stats()["spec"])
            t0 = time.perf_counter()
            outs = _run(engine, prompts, params, f"eval-{k}-{name}")
            wall = time.perf_counter() - t0
            drafts, accepted, per = _spec_delta(before, engine.stats()["spec"])
            row = {"mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
                   "acceptance_per_position": [round(v / drafts, 4) for v in per] if drafts
                   else [], "verify_steps": drafts, "accepted": accepted,
                   "tokens": sum(len(o) for o in outs), "wall_s": round(wall, 2)}
            result["sets"][name][str(k)] = row
            if not quiet:
                pos = " ".join(f"{v:.2f}" for v in row["acceptance_per_position"])
                print(f"outpace: {method} k={k} {name}: mean acceptance length "
                      f"{row['mean_acceptance_length']}, per position [{pos}]", file=sys.stderr)
        del engine
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    if out_json:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(result, indent=1) + "\n")
    if out_png:
        plot_acceptance(result, out_png, quiet=quiet)
    return result


def result_table(result: dict) -> list:
    """eval_draft's result as lines of text: the mean acceptance length, one row a k, one column
    a prompt set ("-": no verify step drafted)."""
    names = list(result["sets"])
    width = max([6, *(len(n) for n in names)])
    lines = [f"mean acceptance length ({result['method']}, greedy, {result['max_tokens']} "
             f"tokens a prompt):",
             f"{'k':>3}" + "".join(f"  {n:>{width}}" for n in names)]
    for k in result["ks"]:
        cells = []
        for n in names:
            mal = result["sets"][n][str(k)]["mean_acceptance_length"]
            cells.append("-" if mal is None else f"{mal:.2f}")
        lines.append(f"{k:>3}" + "".join(f"  {c:>{width}}" for c in cells))
    return lines


def _run(engine, prompts: list, params, tag: str) -> list:
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    try:
        for rid, p in zip(rids, prompts):
            engine.add_request(rid, p, params)
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
    except BaseException:
        for rid in rids:
            engine.abort_request(rid)
        raise
    return [done[r] for r in rids]


def plot_acceptance(result: dict, png, quiet: bool = False) -> Optional[Path]:
    """Chain acceptance per position, one line a k, one panel a prompt set (matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not quiet:
            print("outpace: matplotlib is not installed: no plot (pip install matplotlib)",
                  file=sys.stderr)
        return None
    sets = result["sets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(5.5 * len(sets), 4), squeeze=False)
    for ax, (name, by_k) in zip(axes[0], sets.items()):
        for k, row in sorted(by_k.items(), key=lambda kv: int(kv[0])):
            per = row["acceptance_per_position"]
            if per:
                ax.plot(range(1, len(per) + 1), per, marker="o",
                        label=f"k={k}: τ={row['mean_acceptance_length']:.2f}")
        ax.set_title(f"{result['method']} on {name}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("chain acceptance")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)
