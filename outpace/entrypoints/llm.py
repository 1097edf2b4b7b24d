"""The offline API, shaped like vLLM's `LLM` so users feel at home.

    llm = LLM("smollm2-135m", device="cpu", dtype="float32")
    llm = LLM("smollm2-135m", device="cuda", dtype="float32", weight_dtype="bfloat16")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    outs[0].text, outs[0].token_ids, outs[0].spec_stats
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Union

from outpace.engine.args import EngineArgs
from outpace.engine.engine import LLMEngine
from outpace.types import SamplingParams


class LLM:
    def __init__(self, model: str = EngineArgs.model, **engine_args):
        """engine_args: EngineArgs' fields (engine/args.py lists each with its default), e.g.
        device, dtype (activations, KV cache, arithmetic), weight_dtype (how the large matrices
        are stored; float32 + bfloat16: fp32 compute over bf16 weights), kv_cache_dtype,
        speculative_config, quiet."""
        self.engine = LLMEngine.from_args(model, **engine_args)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's other processes (tensor-parallel ranks) now rather than when this
        LLM is collected or Python exits."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[str, list], sampling_params=None) -> list:
        """prompts: a string, a list of strings, or a list of token-id lists."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        return self._run(list(zip(prompts, params_list)))

    def chat(self, messages: list, sampling_params=None) -> list:
        """messages: one conversation (list of {role, content}) or a list of conversations."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        # special-token text inside a message's content stays plain text (encode_chat)
        ids = [self.tokenizer.chat_token_ids(c, add_generation_prompt=True) for c in convs]
        return self.generate(ids, sampling_params)

    def _run(self, items: list) -> list:
        order = []
        try:
            for prompt, params in items:
                rid = f"llm-{next(self._ids)}"
                # only the final outputs are returned: the engine need not build the others
                self.engine.add_request(rid, prompt,
                                        dataclasses.replace(params, output_kind="final_only"))
                order.append(rid)
            done = {}
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
        except BaseException:
            for rid in order:  # leave nothing half-run in the engine (KV blocks included)
                self.engine.abort_request(rid)
            raise
        return [done[rid] for rid in order]
