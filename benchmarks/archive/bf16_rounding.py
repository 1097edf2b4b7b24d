"""Where does bf16 greedy output part from fp32? A CPU experiment on the check prompts.

    python benchmarks/bf16_rounding.py [--prompts 20]

Runs SmolLM2-135M greedily (64 tokens, the bench_gpu check's prompts) in fp32 as the reference,
then with bf16 rounding applied at chosen points, and counts the prompts whose 64 tokens are
identical to the reference:

  bf16            the whole model in bf16 (what the GPU runs)
  weights         fp32 compute, weights rounded to bf16
  weights+kv      ... and K/V rounded to bf16 before they are cached (a bf16 KV pool)
  weights+kv+q    ... and q rounded too
  weights+kv+in   ... and every projection's input rounded (bf16 tensor-core GEMM inputs)
  weights+kv+in:down_weight   ... only down_proj's input rounded (any weight name works)

Measured on the 2-core CI machine (docs/decisions.md, "bf16 output departs from fp32 through
activations, not weights"; in full in docs/history/decisions-log.md): 8, 20, 19, 16, 16 of 20;
with the input of one projection rounded (qkv, o, gate_up, down, lm_head): 15, 14, 18, 16, 18
of 20.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import prompt_set  # noqa: E402

VARIANTS = {"bf16": None, "weights": set(), "weights+kv": {"kv"}, "weights+kv+q": {"kv", "q"},
            "weights+kv+in": {"kv", "in"}}


def _bf16(t):
    return t.bfloat16().float()


class _Rounding:
    """Patches the decoder so the chosen tensors are rounded to bf16 (values stay fp32)."""

    def __init__(self, points: set):
        import outpace.models.llama as llama
        self.llama, self.points = llama, points
        self.saved = (llama.linear, llama.LlamaAttention.attend)

    def __enter__(self):
        llama, points = self.llama, self.points
        linear, attend = self.saved

        def rounded_linear(x, module, name, bias=None):
            if "in" in points or f"in:{name}" in points:
                x = _bf16(x)
            return linear(x, module, name, bias)

        def rounded_attend(mod, qkv, cos_sin, rope, ctx):
            backend = ctx.backend

            class Rounded:
                def __getattr__(self, a):
                    return getattr(backend, a)

                def forward(self, layer, q, k, v, meta):
                    if "q" in points:
                        q = _bf16(q)
                    if "kv" in points:
                        k, v = _bf16(k), _bf16(v)
                    return backend.forward(layer, q, k, v, meta)

            return attend(mod, qkv, cos_sin, rope, type(ctx)(Rounded(), ctx.meta))

        llama.linear = rounded_linear
        llama.LlamaAttention.attend = rounded_attend
        return self

    def __exit__(self, *exc):
        self.llama.linear, self.llama.LlamaAttention.attend = self.saved


def main():
    from outpace import LLM, SamplingParams
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--variants", nargs="*", default=None,
                    help="names from VARIANTS, or extra ones like weights+kv+in:down_weight "
                         "(rounding points joined by +: kv, q, in, in:<weight name>)")
    args = ap.parse_args()
    variants = VARIANTS if not args.variants else {
        v: VARIANTS.get(v, set(v.split("+")) - {"weights"}) for v in args.variants}
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    ref_llm = LLM("smollm2-135m", device="cpu", dtype="float32", quiet=True)
    prompts = prompt_set(ref_llm.tokenizer, args.prompts)
    ref = [o.token_ids for o in ref_llm.generate(prompts, sp)]
    del ref_llm
    for name, points in variants.items():
        llm = LLM("smollm2-135m", device="cpu", dtype="bfloat16" if points is None else "float32",
                  quiet=True)
        if points is not None:
            model = llm.engine.runner.model
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(_bf16(p))
                model.add_cpu_weight_copies_()  # the copies must hold the rounded values too
            with _Rounding(points):
                out = [o.token_ids for o in llm.generate(prompts, sp)]
        else:
            out = [o.token_ids for o in llm.generate(prompts, sp)]
        same = sum(a == b for a, b in zip(out, ref))
        print(f"{name:16s} identical {same} / {len(ref)}", flush=True)


if __name__ == "__main__":
    main()
