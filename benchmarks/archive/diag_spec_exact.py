"""Where greedy output with speculation first parts from the output without it, on the GPU in
bf16 (bench_gpu.py's spec_exact section counts how often; this finds which kernel).

Two eager engines on the same prompts, one request at a time: no speculation, and EAGLE-3 k = 2
with a random head verified for real (its drafts nearly always rejected, so every committed
token passes through row 0 of a 3-row verify step where the plain engine runs a 1-row step).
Every target layer's few-row forward is wrapped: the output rows of its qkv (with rope and the
KV store), attention, o_proj, gate_up and down kernels, and of the LM head, are recorded by the
KV slot the row writes (a position of the request; a rejected draft's row is recorded again
when its position is verified for real, the last write wins). For each prompt the first
position, layer and kernel whose row differs between the engines is reported: everything before
it (every layer of every earlier position, so the KV it reads) was bit for bit the same.

    python benchmarks/diag_spec_exact.py --gguf PATH [--out DIR] [--prompts 8] [--max-tokens 64]
        [--policy current]

--policy: a few-row block policy of benchmarks/diag_few_rows.py for both engines (inv_m1,
inv_m3: one configuration for every launch of at most 16 rows).
"""
from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import diag_setup, make_heads  # noqa: E402

KINDS = ("qkv", "attention", "o_proj", "gate_up", "down")


@dataclass
class Recording:
    """One engine's run of one prompt: rows[(layer, kind, slot)] and the slots in the order
    their positions were first computed (the LM head is layer num_layers)."""
    rows: dict
    order: list
    num_layers: int


class Recorder:
    """Wraps the few-row forward's kernels; rows[(layer, kind, slot)] = the row (on the host)."""

    def __init__(self, num_layers: int):
        import outpace.models.llama as llama
        self.llama, self.num_layers = llama, num_layers
        self.layer, self.calls = None, 0
        self.reset()

    def _put(self, kind: str, out: torch.Tensor) -> None:
        if self.layer is None:
            return
        flat = out.reshape(out.shape[0], -1).cpu()  # sync-ok: a diagnostic
        for i, s in enumerate(self.slots):
            if s >= 0:
                self.rows[(self.layer, kind, s)] = flat[i].clone()

    def install(self) -> None:
        llama, rec = self.llama, self
        layer_cls = llama.LlamaDecoderLayer
        orig_forward = layer_cls.forward_few_rows

        def forward_few_rows(layer, residual, cos_sin, rope, ctx, attn_input=None, out=None):
            target = layer.self_attn.layer_slot < rec.num_layers
            rec.layer = layer.self_attn.layer_slot if target else None
            rec.calls = 0
            if target:
                rec.slots = ctx.meta.slot_mapping.tolist()  # sync-ok: a diagnostic
                for s in rec.slots:
                    if s >= 0 and s not in rec.seen:
                        rec.seen.add(s)
                        rec.order.append(s)
            res = orig_forward(layer, residual, cos_sin, rope, ctx, attn_input, out)
            rec.layer = None
            return res

        def wrap(name, kind_of):
            fn = getattr(llama, name)

            def wrapped(*a, **kw):
                out = fn(*a, **kw)
                rec._put(kind_of(), out)
                return out
            setattr(llama, name, wrapped)

        def small_linear_kind():  # o_proj, then down, in each layer
            rec.calls += 1
            return "o_proj" if rec.calls == 1 else "down"
        wrap("norm_qkv_rope_store", lambda: "qkv")
        wrap("small_linear", small_linear_kind)
        wrap("norm_small_linear_silu_mul", lambda: "gate_up")
        layer_cls.forward_few_rows = forward_few_rows
        from outpace.attention.torch_ref import TorchRefBackend
        from outpace.attention.triton_paged import TritonPagedBackend
        for cls in (TritonPagedBackend, TorchRefBackend):  # (the latter: a CPU dry run)
            orig_attend = cls.attend_stored

            def attend_stored(backend, layer, q, meta, _orig=orig_attend):
                out = _orig(backend, layer, q, meta)
                rec._put("attention", out)
                return out
            cls.attend_stored = attend_stored
        orig_greedy = llama.LlamaForCausalLM.greedy_tokens

        def greedy_tokens(model, hidden, also=()):
            if hidden.shape[0] <= 16 and rec.slots is not None:
                logits = llama.linear(hidden, model, "lm_head_weight")
                rec.layer = rec.num_layers
                rec._put("lm_head", logits)
                rec.layer = None
            return orig_greedy(model, hidden, also)
        llama.LlamaForCausalLM.greedy_tokens = greedy_tokens

    def reset(self) -> None:
        self.rows, self.order, self.seen, self.slots = {}, [], set(), None

    def recording(self) -> Recording:
        return Recording(self.rows, self.order, self.num_layers)


def first_difference(a: Recording, b: Recording):
    """-> (position index, layer, kind) of the first row that differs, or None."""
    for p, slot in enumerate(a.order):
        for layer in range(a.num_layers + 1):
            for kind in KINDS + ("lm_head",):
                ra, rb = a.rows.get((layer, kind, slot)), b.rows.get((layer, kind, slot))
                if ra is None or rb is None:
                    continue
                if not torch.equal(ra, rb):
                    diff = (ra.float() - rb.float()).abs()
                    return {"position": p, "layer": layer, "kind": kind,
                            "elements_differing": int((diff > 0).sum()),
                            "max_abs_diff": float(diff.max())}
    return None


def main():
    args, loaded, prompts = diag_setup(20, extra=(("--prompts", "8"), ("--max-tokens", "64"),
                                                  ("--policy", "current")))
    import outpace.kernels.skinny_gemm as sl
    from benchmarks.archive.diag_few_rows import policies
    sl.choose_blocks = policies(sl.choose_blocks)[args.policy]
    from outpace import SamplingParams
    from outpace.engine.engine import LLMEngine
    n, max_tokens = int(args.prompts), int(args.max_tokens)
    eagle, _ = make_heads(args.gguf, tempfile.mkdtemp())
    num_layers = loaded[1].num_hidden_layers
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engines = {}
    device = str(loaded[0].embed_weight.device)
    for name, spec in (("no-spec", None),
                       ("eagle3-k2", {"method": "eagle3", "model": str(eagle),
                                      "num_speculative_tokens": 2})):
        engines[name] = LLMEngine.from_args(
            args.gguf, loaded=loaded, device=device, dtype=str(loaded[0].dtype).split(".")[1],
            speculative_config=spec,
            max_num_seqs=1, num_kv_blocks=1024, quiet=True, enable_prefix_caching=False,
            enforce_eager=True)
    rec = Recorder(num_layers)
    rec.install()
    report = {"prompts": n, "max_tokens": max_tokens, "policy": args.policy, "cases": []}
    firsts = Counter()
    for i, p in enumerate(prompts[:n]):
        outs, recs = {}, {}
        for name, eng in engines.items():
            rec.reset()
            eng.add_request(f"{name}-{i}", p, sp)
            toks = []
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        toks = list(o.token_ids)
            outs[name] = toks
            recs[name] = rec.recording()
        a, b = outs["no-spec"], outs["eagle3-k2"]
        tok = next((j for j, (u, v) in enumerate(zip(a, b)) if u != v), None)
        first = first_difference(recs["no-spec"], recs["eagle3-k2"])
        if first is not None:
            firsts[(first["layer"] if first["kind"] != "lm_head" else "head", first["kind"])] += 1
        case = {"prompt": i, "first_token_differing": tok, "first_row_differing": first}
        report["cases"].append(case)
        print(json.dumps(case), flush=True)
    report["first_kinds"] = dict(Counter(k[1] for k in firsts.elements()))
    print("first differing kernel over the prompts:", report["first_kinds"], flush=True)
    report["identical"] = sum(c["first_token_differing"] is None for c in report["cases"])
    print("identical outputs:", report["identical"], "of", n, flush=True)
    out = Path(args.out) / f"diag_spec_exact_{args.policy}.json"
    out.write_text(json.dumps(report, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
