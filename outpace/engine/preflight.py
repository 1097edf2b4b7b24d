"""Every argument of an engine checked before anything heavy loads: torch, the model's weights,
a download of them. A wrong argument is then one error in a fraction of a second, not after a
load of seconds (or a download of gigabytes).

Nothing here imports torch: the checks use the config dataclasses (outpace/config.py and the
modules beside it), the model's config alone (config.json or the GGUF header; a Hugging Face
id's config is fetched without its weights) and the draft head's folder. Errors name each option by its config key
(`OutpaceError.option`); the CLI respells them as its flags (errors.spelled).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from outpace.config import CacheConfig, SchedulerConfig
from outpace.engine.args import EngineArgs
from outpace.errors import ConfigError, ModelLoadError
from outpace.model_config import ModelConfig
from outpace.runner_config import KernelOptions, RunnerConfig
from outpace.speculative_config import SpecConfig, check_draft_weight_dtype

DRAFT_PATH = "speculative_config['model']"  # the option a draft head's folder is given as


@dataclass(frozen=True)
class CheckedArgs:
    """What the checks built, for the builder to use as it is."""

    spec: SpecConfig  # the shipped head filled in, "~" expanded in the draft path
    cache: CacheConfig
    chat_template: Optional[str]  # the template's text (from a file or given as it is)
    model_config: Optional[ModelConfig]  # None where it was not read (a lent model)


def check_max_model_len(max_model_len: Optional[int], model_cfg: ModelConfig) -> None:
    limit = model_cfg.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ConfigError(f"max_model_len={max_model_len} is longer than the model's "
                          f"{limit} positions; use at most {limit}", option="max_model_len")


def check_draft_folder(spec: SpecConfig) -> SpecConfig:
    """A draft head's folder exists and holds a head's files (config.json, weights): checked
    before the target loads. -> spec with "~" expanded in the path."""
    if spec.method not in ("eagle3", "mtp") or spec.model is None:
        return spec
    path = Path(spec.model).expanduser()
    hint = ("give the folder of a draft head (config.json and model.safetensors), as "
            "`outpace init-draft` or `outpace train-draft` write it")
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        raise ModelLoadError(f"{DRAFT_PATH} {spec.model!r} {what}; {hint}", option=DRAFT_PATH)
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        missing.append("*.safetensors weight file")
    if missing:
        raise ModelLoadError(f"{DRAFT_PATH} {spec.model!r} is not a draft head folder: it has "
                             f"no {' and no '.join(missing)}; {hint}", option=DRAFT_PATH)
    return dataclasses.replace(spec, model=str(path)) if str(path) != spec.model else spec


def check_mtp_mode(spec: SpecConfig, block_size: int) -> None:
    """An MTP head's mode against the options and the head's module count, from its config.json
    alone (the rules MTPProposer and MTPWindowProposer apply once the head is loaded): a wrong
    --k or draft_lm_head_dtype must not cost the target's load first. A config.json that can't
    tell is left to the loader, whose errors say what is wrong with it."""
    if spec.method != "mtp" or spec.model is None:
        return
    try:
        config = json.loads((Path(spec.model) / "config.json").read_text(encoding="utf-8"))
        n = config.get("num_nextn_predict_layers")
    except (OSError, ValueError, RecursionError, AttributeError):
        return
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return
    if (spec.mtp_mode or ("eagle" if n == 1 else "depths")) != "depths":
        return
    k = spec.num_speculative_tokens
    if k > n:
        raise ConfigError(f"mtp_mode 'depths' drafts one token per module: the head has {n} "
                          f"modules, so num_speculative_tokens must be <= {n} (or use mtp_mode "
                          f"'eagle')", option="num_speculative_tokens")
    if spec.draft_lm_head_dtype != "auto":
        raise ConfigError("draft_lm_head_dtype applies to EAGLE-3 heads and MTP's 'eagle' mode; "
                          "mtp_mode 'depths' drafts from each module's logits (leave "
                          "draft_lm_head_dtype unset or use mtp_mode 'eagle')",
                          option="draft_lm_head_dtype")
    if k > block_size:
        raise ConfigError(f"mtp_mode 'depths' needs num_speculative_tokens ({k}) <= block_size "
                          f"({block_size}); lower k or raise block_size",
                          option="num_speculative_tokens")


def _check_bools(**flags) -> None:
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise ConfigError(f"{name} must be true or false, got {v!r}", option=name)


def check_tensor_parallel(a: EngineArgs, spec) -> None:
    """tensor_parallel_size against what runs sharded; the model's shapes are checked once
    its config is read (parallel/shard.check_shardable)."""
    from outpace.option_checks import check_int
    check_int("tensor_parallel_size", a.tensor_parallel_size, 1, 64)
    if a.tensor_parallel_size == 1:
        return
    if a.device not in ("cpu", "auto"):  # auto: the builder checks it resolves to the CPU
        raise ConfigError(f"tensor_parallel_size={a.tensor_parallel_size} runs on the CPU "
                          f"(device cpu) for now; on {a.device!r} use tensor_parallel_size 1",
                          option="tensor_parallel_size")
    if spec.draft_lm_head_dtype != "auto":  # the int8 copy would be of one rank's rows
        raise ConfigError(f"draft_lm_head_dtype {spec.draft_lm_head_dtype!r} does not run under "
                          f"tensor parallelism yet: leave it 'auto' or use "
                          f"tensor_parallel_size 1", option="tensor_parallel_size")
    if a.loaded is not None:
        raise ConfigError("a loaded model can't be shared with tensor-parallel ranks (each "
                          "process loads its own part): pass the model's path instead",
                          option="tensor_parallel_size")


def check_engine_args(args: EngineArgs) -> CheckedArgs:
    """The engine's arguments checked, cheapest first, the model's config last (it may be
    fetched): a ConfigError or ModelLoadError naming the option. The model's config is not read
    when a loaded model is lent (`loaded`)."""
    a = args
    model = a.model
    if model is None or not isinstance(model, (str, Path)) or not str(model):
        raise ConfigError(f"model must be a catalog name, a path or a Hugging Face model id, "
                          f"got {model!r}", option="model")
    _check_bools(enable_prefix_caching=a.enable_prefix_caching,
                 enable_chunked_prefill=a.enable_chunked_prefill, enforce_eager=a.enforce_eager,
                 overlap=a.overlap, quiet=a.quiet)
    if a.kernel_options is not None and not isinstance(a.kernel_options, KernelOptions):
        raise ConfigError(f"kernel_options must be a KernelOptions (or None: every fast path "
                          f"on), got {type(a.kernel_options).__name__}", option="kernel_options")
    # "auto" resolves to cuda or cpu once torch is loaded (the builder checks the dtypes again
    # there): here the rules that hold on either
    runner = RunnerConfig(device="cpu" if a.device == "auto" else a.device, dtype=a.dtype,
                          weight_dtype=a.weight_dtype, kv_cache_dtype=a.kv_cache_dtype,
                          seed=a.seed)

    if a.speculative_config is not None and not isinstance(a.speculative_config, dict):
        raise ConfigError(f"speculative_config must be a dict (vLLM's speculative_config, e.g. "
                          f"{{'method': 'ngram', 'num_speculative_tokens': 3}}), got "
                          f"{type(a.speculative_config).__name__}", option="speculative_config")
    from outpace.models.shipped_heads import with_shipped_head
    spec = check_draft_folder(SpecConfig.from_dict(with_shipped_head(a.speculative_config,
                                                                     model)))

    # the token budget's default depends on the GPU (builder.default_token_budget): any valid
    # value stands in for it here
    SchedulerConfig(max_num_seqs=a.max_num_seqs,
                    max_num_batched_tokens=(2048 if a.max_num_batched_tokens is None
                                            else a.max_num_batched_tokens),
                    max_model_len=a.max_model_len,
                    enable_chunked_prefill=a.enable_chunked_prefill,
                    max_waiting_requests=a.max_waiting_requests,
                    max_prefill_with_decodes=(0 if a.max_prefill_with_decodes is None
                                              else a.max_prefill_with_decodes))
    if a.num_kv_blocks is not None:
        from outpace.option_checks import check_int
        check_int("num_kv_blocks", a.num_kv_blocks, 2, why=" (block 0 is reserved)")
    if a.memory_fraction is not None and a.gpu_memory_utilization is not None:
        raise ConfigError("memory_fraction and gpu_memory_utilization both size the KV pool: "
                          "give one (gpu_memory_utilization, as in vLLM: a share of the GPU's "
                          "total memory; memory_fraction: a share of what the weights leave "
                          "free)", option="gpu_memory_utilization")
    memory = dict(gpu_memory_utilization=a.gpu_memory_utilization,
                  **({} if a.memory_fraction is None else {"memory_fraction": a.memory_fraction}))
    cache = CacheConfig(block_size=a.block_size, num_blocks=a.num_kv_blocks,
                        enable_prefix_caching=a.enable_prefix_caching, **memory)
    check_mtp_mode(spec, a.block_size)
    if a.device != "auto" or a.dtype != "auto":  # (else decided once the device is known)
        check_draft_weight_dtype(spec.draft_weight_dtype, runner.dtype_name)

    template = None
    if a.chat_template is not None:
        from outpace.chat_template import load_chat_template
        template = load_chat_template(a.chat_template)

    check_tensor_parallel(a, spec)

    model_cfg = None
    if a.loaded is None:
        # the config alone: config.json, or the GGUF header (a catalog model is fetched whole,
        # its config being in its one file; a Hugging Face id's weights are not)
        from outpace.models.loader import load_model_config
        from outpace.parallel.shard import check_shardable
        model_cfg = load_model_config(model, quiet=a.quiet, download_dir=a.download_dir)
        check_max_model_len(a.max_model_len, model_cfg)
        check_shardable(model_cfg, a.tensor_parallel_size)
    return CheckedArgs(spec=spec, cache=cache, chat_template=template, model_config=model_cfg)
