"""Helpers shared by engine-level tests: engines over one loaded model, runs, plan recording."""

from __future__ import annotations

import itertools

from outpace.engine.engine import LLMEngine

_ids = itertools.count()


def make_engine(loaded, model: str = "loaded", **kwargs) -> LLMEngine:
    """A fresh engine (own KV pool, scheduler) over an already loaded (model, cfg, tokenizer);
    `model`: the name it was loaded by (a catalog name finds its shipped draft heads)."""
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("num_kv_blocks", 400)
    engine = LLMEngine.from_args(model, loaded=loaded, quiet=True, **kwargs)
    _ENGINES.append(engine)
    return engine


_ENGINES: list = []


def engines_made() -> list:
    return _ENGINES


def chat_ids(tok, questions, system=None) -> list:
    out = []
    for q in questions:
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": q}]
        out.append(tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True),
                              add_special_tokens=False))
    return out


def run_batch(engine: LLMEngine, prompts, params) -> list:
    """All prompts in one engine at once; returns token id lists in prompt order."""
    return [o.token_ids for o in run_batch_outputs(engine, prompts, params)]


def run_batch_outputs(engine: LLMEngine, prompts, params) -> list:
    """run_batch's finished RequestOutputs, in prompt order."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    rids = [f"b{next(_ids)}" for _ in prompts]
    for rid, p, sp in zip(rids, prompts, plist):
        engine.add_request(rid, p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [done[r] for r in rids]


def run_alone(engine: LLMEngine, prompt, params) -> list:
    return run_batch(engine, [prompt], params)[0]


class PlanRecorder:
    """Records every StepPlan the engine's scheduler produces."""

    def __init__(self, engine: LLMEngine):
        self.plans = []
        inner = engine.scheduler.schedule

        def schedule():
            plan = inner()
            self.plans.append(plan)
            return plan

        engine.scheduler.schedule = schedule
