"""The engine side of `bench latency` and `bench throughput`: their shared flags (the model, the
CLI's engine flags, the prompts), the engine loaded after every flag is checked, prompts as
token ids, a set of requests run to completion, and the speculative counters of a run."""

from __future__ import annotations

import time
from typing import Callable, Optional

from outpace.bench.datasets import cycle, load_dataset, random_token_prompts
from outpace.bench.report import at_least
from outpace.errors import ConfigError, OutpaceError, spelled

SAMPLING_FLAGS = {"temperature": "--temperature", "max_tokens": "--output-len"}


def add_engine_and_prompt_args(p, input_len: int, output_len: int) -> None:
    """MODEL, the CLI's engine flags, and the prompts' flags (random prompts of --input-len
    tokens by default)."""
    from outpace.entrypoints.cli import add_engine_args, add_model_arg
    add_model_arg(p)
    add_engine_args(p)
    p.add_argument("--input-len", type=int, default=None,
                   help=f"tokens of each random prompt (default: {input_len}; not with "
                   f"--dataset, whose prompts are as long as they are)")
    p.add_argument("--output-len", type=int, default=output_len,
                   help="output tokens of each request (the end-of-sequence token ignored)")
    p.add_argument("--dataset", default=None, metavar="FILE",
                   help='prompts from a file: JSONL of {"prompt": ...} (as '
                   'benchmarks/prompts/*.jsonl), or ShareGPT conversations (JSON or JSONL; '
                   'the first human turn) (default: random token ids)')
    p.add_argument("--as-chat", action="store_true",
                   help="--dataset prompts as a user turn in the model's chat template (as "
                   "`outpace generate` sends them; default: the text as it is)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--output-json", default=None, metavar="FILE",
                   help="write the results as JSON")
    p.set_defaults(default_input_len=input_len)


def check_prompt_args(a, num_prompts: int) -> Optional[list]:
    """The prompt flags, checked before the engine loads -> the dataset's texts (None: random
    prompts; a.input_len is then set)."""
    from outpace.entrypoints.cli_options import model_of
    a.model = model_of(a)  # the results name it
    at_least(a.output_len, 1, "--output-len")
    at_least(a.input_len, 1, "--input-len")
    if a.dataset is not None and a.input_len is not None:
        raise ConfigError("--input-len sets random prompts' length: leave it out with "
                          "--dataset, or leave --dataset out", option="input_len")
    if a.as_chat and a.dataset is None:
        raise ConfigError("--as-chat applies to --dataset prompts; random prompts are token "
                          "ids", option="as_chat")
    if a.max_model_len is not None and a.dataset is None:
        fits(a.default_input_len if a.input_len is None else a.input_len, a.output_len,
             a.max_model_len)
    if a.dataset is None:
        if a.input_len is None:
            a.input_len = a.default_input_len
        return None
    return load_dataset(a.dataset, limit=num_prompts)


def fits(input_len: int, output_len: int, max_model_len: int) -> None:
    if input_len + output_len > max_model_len:
        raise ConfigError(f"--input-len {input_len} + --output-len {output_len} is more than the "
                          f"context ({max_model_len} tokens); shorten them or raise "
                          f"--max-model-len", option="input_len")


def sampling_params(a):
    from outpace.types import SamplingParams
    try:
        # fixed-length outputs (as vLLM's benchmarks); only the finished output is built
        return SamplingParams(max_tokens=a.output_len, temperature=a.temperature,
                              ignore_eos=True, output_kind="final_only")
    except OutpaceError as e:
        raise spelled(e, SAMPLING_FLAGS) from None


def load_engine(a):
    """The engine of the CLI's engine flags, checked first (errors name the flags)."""
    from outpace.entrypoints.cli_options import load_engine as cli_load_engine
    return cli_load_engine(a)


def prompt_ids(engine, a, texts: Optional[list], num: int, seed: int) -> list:
    """`num` prompts as token ids: random ones of a.input_len tokens, or the dataset's texts
    (in order, repeated as needed) less those that leave no room for --output-len."""
    if texts is None:
        fits(a.input_len, a.output_len, engine.max_model_len)
        return random_token_prompts(num, a.input_len, engine.vocab_size, seed)
    tok = engine.tokenizer
    room = engine.max_model_len - a.output_len
    ids = []
    for text in texts:
        if a.as_chat and tok.has_chat_template:
            one = tok.chat_token_ids([{"role": "user", "content": text}],
                                     add_generation_prompt=True)
        else:
            one = tok.encode(text)
        if 0 < len(one) <= room:
            ids.append(one)
    if not ids:
        raise ConfigError(f"no prompt of --dataset {a.dataset!r} leaves room for --output-len "
                          f"{a.output_len} in the context ({engine.max_model_len} tokens)",
                          option="dataset")
    return cycle(ids, num)


def run_requests(engine, prompts: list, params, tag: str,
                 on_finished: Optional[Callable] = None, max_in_flight: Optional[int] = None,
                 step_times: Optional[list] = None) -> tuple:
    """`prompts` run to completion in the engine -> (seconds, finished outputs in prompt
    order). Every prompt is given to the engine at once, or with max_in_flight at most that
    many at a time, the next as one finishes (a closed loop, as a load client bounded to that
    concurrency sends them to a server). on_finished(output) as each finishes; step_times gets
    each engine.step()'s seconds. Interrupted, every request is aborted: nothing is left in the
    engine."""
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    bound = len(prompts) if max_in_flight is None else max_in_flight
    if bound < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    done: dict = {}
    added = 0
    t0 = time.perf_counter()
    try:
        while added < len(prompts) or engine.has_unfinished_requests():
            while added < len(prompts) and added - len(done) < bound:
                engine.add_request(rids[added], prompts[added], params)
                added += 1
            ts = time.perf_counter()
            outs = engine.step()
            if step_times is not None:
                step_times.append(time.perf_counter() - ts)
            for out in outs:
                if out.finished:
                    done[out.request_id] = out
                    if on_finished is not None:
                        on_finished(out)
    except BaseException:
        for rid in rids[:added]:
            if rid not in done:
                engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        raise
    return time.perf_counter() - t0, [done[r] for r in rids]


def spec_counters(engine) -> dict:
    """The engine's speculative counters so far (SpecStats.as_dict)."""
    return engine.spec_stats.as_dict()


def spec_result(before: dict, after: dict) -> dict:
    """A run's speculative counters (after - before) and its mean acceptance length (tokens
    per verify step, bonus included: 1 + accepted / drafts)."""
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    d = {k: after[k] - before[k] for k in keys}
    d["mean_acceptance_length"] = (1.0 + d["num_accepted_tokens"] / d["num_drafts"]
                                   if d["num_drafts"] else 1.0)
    return d


def spec_config(a):
    """The speculative config the flags give (for the result's record)."""
    from outpace.entrypoints.cli_options import engine_kwargs
    return engine_kwargs(a)["speculative_config"]
