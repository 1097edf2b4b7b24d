"""How often does an int8 LM head change a greedy token? A CPU measurement on SmolLM2-135M.

    python benchmarks/int8_lm_head_agreement.py [--prompts 20] [--tokens 64]

The speculative option draft_lm_head_dtype="int8" has a head draft from an int8 copy of its LM
head (per-row scale, kernels/int8_linear.quantize_int8_rows). The output does not change (the
target verifies every draft), but a draft the bf16 head would have proposed can be replaced
where two logits lie within the quantization error, which costs acceptance. No trained head
exists for SmolLM2, so this measures the nearest thing: the target's own LM head (an MTP head
drafts through it) over the final hidden states of greedy decoding on the bench's check
prompts, bf16-rounded as on the GPU: the share of positions where the int8 head's argmax is the
bf16 head's. Measured on the CI machine: 99.0% of 1280 positions (an fp8 e4m3 copy with the
same per-row scale: 95.1%).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import prompt_set  # noqa: E402


def main():
    import outpace.models.llama as llama
    from outpace import LLM, SamplingParams
    from outpace.kernels.int8_linear import int8_linear_ref, quantize_int8_rows
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    caught = []
    inner = llama.linear

    def spy(x, module, name, bias=None):  # the LM head's input: the normed final hidden
        if name == "lm_head_weight":
            caught.append(x.detach().float().reshape(-1, x.shape[-1]).clone())
        return inner(x, module, name, bias)
    llama.linear = spy
    llm = LLM("smollm2-135m", device="cpu", dtype="float32", quiet=True)
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompt_set(llm.tokenizer, args.prompts), sp)
    llama.linear = inner
    hidden = torch.cat(caught).bfloat16().float()
    w = llm.engine.runner.model.lm_head_weight.detach().bfloat16().float()
    want = (hidden @ w.T).argmax(-1)
    q, scale = quantize_int8_rows(w)
    got = int8_linear_ref(hidden, q, scale).argmax(-1)
    fp8 = (w / (w.abs().amax(1, keepdim=True) / 448)).to(torch.float8_e4m3fn).float() \
        * (w.abs().amax(1, keepdim=True) / 448)
    got_fp8 = (hidden @ fp8.T).argmax(-1)
    share = (got == want).float().mean().item()
    share_fp8 = (got_fp8 == want).float().mean().item()
    print(f"positions {len(want)}: int8 head's argmax = bf16 head's on {share:.2%}, "
          f"fp8 e4m3 {share_fp8:.2%}")


if __name__ == "__main__":
    main()
