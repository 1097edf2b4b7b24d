"""The CLI's parsed flags -> the engine's arguments (`EngineArgs`, checked before torch or the
model loads) and `SamplingParams`; errors about an option respelled as the flag the user typed
(errors.spelled)."""

from __future__ import annotations

import argparse
import json

from outpace.errors import OutpaceError, spelled

# How the CLI spells the options its errors name (errors.spelled): config key -> flag.
ENGINE_FLAGS = {
    "device": "--device", "dtype": "--dtype",
    "weight_dtype": "--weight-dtype", "kv_cache_dtype": "--kv-cache-dtype",
    "max_model_len": "--max-model-len", "num_kv_blocks": "--num-kv-blocks",
    "gpu_memory_utilization": "--gpu-memory-utilization", "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_prefill_with_decodes": "--max-prefill-with-decodes", "seed": "--seed",
    "chat_template": "--chat-template", "max_waiting_requests": "--max-waiting",
    "tensor_parallel_size": "--tensor-parallel-size"}
# ... where the speculative config came from --spec and its flags (not --speculative-config,
# whose errors name its JSON keys)
SPEC_FLAGS = {"method": "--spec", "num_speculative_tokens": "--k",
              "speculative_config['model']": "--draft"}
SAMPLING_FLAGS = {
    "max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
    "top_k": "--top-k", "min_p": "--min-p", "seed": "--sample-seed",
    "repetition_penalty": "--repetition-penalty", "frequency_penalty": "--frequency-penalty",
    "presence_penalty": "--presence-penalty", "max_model_len": "--max-model-len"}
SERVER_FLAGS = {"port": "--port", "timeout_keep_alive": "--timeout-keep-alive",
                "host": "--host", "api_server_count": "--api-server-count"}


def _parse_value(v: str):
    """A --spec-option value: JSON where it parses (numbers, true/false, lists such as
    k_schedule=[[8,4],[32,2]]), true/false in any case, else the string itself."""
    try:
        return json.loads(v)
    except (ValueError, RecursionError):
        return {"true": True, "false": False}.get(v.lower(), v)


def engine_flags(a: argparse.Namespace) -> dict:
    """Config key -> flag, for the engine's errors on this command line."""
    return {**ENGINE_FLAGS, **({} if a.speculative_config is not None else SPEC_FLAGS)}


def spec_options(items: list) -> dict:
    """--spec-option KEY=VALUE items -> {key: value} (values as JSON where they parse)."""
    out = {}
    for kv in items:
        if "=" not in kv:
            raise OutpaceError(f"--spec-option wants KEY=VALUE, got {kv!r}")
        key, val = kv.split("=", 1)
        out[key] = _parse_value(val)
    return out


def engine_kwargs(a: argparse.Namespace) -> dict:
    spec = None
    if a.speculative_config is not None:
        if a.spec or a.draft or a.k is not None or a.spec_option:
            raise OutpaceError("--speculative-config holds the whole speculative config: leave "
                               "out --spec, --draft, --k and --spec-option, or use those alone")
        try:
            spec = json.loads(a.speculative_config)
        except (ValueError, RecursionError) as e:
            raise OutpaceError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise OutpaceError(f"--speculative-config must be a JSON object, got "
                               f"{type(spec).__name__}")
    elif not a.spec:
        given = [f for f, v in (("--draft", a.draft), ("--k", a.k),
                                ("--spec-option", a.spec_option or None)) if v is not None]
        if given:
            raise OutpaceError(f"speculative options without --spec ({', '.join(given)}): add "
                               f"--spec eagle3|mtp|ngram|suffix, or leave them out")
    else:
        spec = {"method": a.spec, "num_speculative_tokens": 3 if a.k is None else a.k}
        if a.draft:
            spec["model"] = a.draft
        spec.update(spec_options(a.spec_option))
    return dict(device=a.device, dtype=a.dtype, weight_dtype=a.weight_dtype,
                kv_cache_dtype=a.kv_cache_dtype,
                max_model_len=a.max_model_len,
                num_kv_blocks=a.num_kv_blocks, max_num_seqs=a.max_num_seqs,
                gpu_memory_utilization=a.gpu_memory_utilization,
                max_num_batched_tokens=a.max_num_batched_tokens,
                max_prefill_with_decodes=a.max_prefill_with_decodes,
                enable_prefix_caching=not a.no_prefix_caching, enforce_eager=a.enforce_eager,
                overlap=not a.no_overlap, seed=a.seed, speculative_config=spec,
                tensor_parallel_size=a.tensor_parallel_size,
                chat_template=a.chat_template, quiet=a.quiet, download_dir=a.download_dir)


def sampling_params(a: argparse.Namespace):
    """The sampling flags as SamplingParams; a bad value is an error naming its flag."""
    from outpace.types import SamplingParams
    try:
        return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature,
                              top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                              repetition_penalty=a.repetition_penalty,
                              frequency_penalty=a.frequency_penalty,
                              presence_penalty=a.presence_penalty, seed=a.sample_seed)
    except OutpaceError as e:
        raise spelled(e, SAMPLING_FLAGS) from None


def model_of(a: argparse.Namespace) -> str:
    """The model a command line names: MODEL (where the command takes it) or --model, the same
    if both are given, else EngineArgs' default."""
    from outpace.engine.args import EngineArgs
    pos, flag = getattr(a, "model_pos", None), a.model
    if pos is not None and flag is not None and pos != flag:
        raise OutpaceError(f"two models: MODEL {pos!r} and --model {flag!r}; give one of them")
    return next((m for m in (pos, flag) if m is not None), EngineArgs().model)


def engine_args(a: argparse.Namespace, **more):
    """The command line's EngineArgs (`more`: a command's own engine arguments), checked before
    torch or the model loads (engine/preflight.py), so a wrong flag is an error at once; the
    error names the flag."""
    from outpace.engine.args import EngineArgs
    from outpace.engine.preflight import check_engine_args
    try:
        args = EngineArgs(model=model_of(a), **engine_kwargs(a), **more)
        check_engine_args(args)
    except OutpaceError as e:
        raise spelled(e, engine_flags(a)) from None
    return args


def load_engine(a: argparse.Namespace):
    """The engine of generate and chat, its flags checked first."""
    args = engine_args(a)
    from outpace.engine.engine import LLMEngine
    try:
        return LLMEngine.from_engine_args(args)
    except OutpaceError as e:
        raise spelled(e, engine_flags(a)) from None
