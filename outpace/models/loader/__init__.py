"""Model loading facade: a catalog name, HF folder or .gguf file -> (model, ModelConfig, tokenizer).

    model, cfg, tok = load_model("smollm2-135m", RunnerConfig())
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from outpace.errors import ModelLoadError


def locate(path_or_name, quiet: bool = False, download_dir=None,
           weights: bool = True) -> tuple[str, Path]:
    """-> ("hf", folder) or ("gguf", file). Catalog names and Hugging Face model ids are
    fetched into their caches first (a model id's: `download_dir`, else Hugging Face's; with
    weights=False its config and tokenizer only)."""
    from outpace.models.catalog import resolve_model
    path = resolve_model(path_or_name, quiet, download_dir=download_dir, weights=weights)
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf", path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        hint = (f"it holds several .gguf files ({', '.join(p.name for p in ggufs)}): pass one"
                if ggufs else "pass a Hugging Face model folder or a .gguf file")
        raise ModelLoadError(f"{path} has no config.json; {hint}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"can't read {path}: {e}") from e
    if magic == b"GGUF" or path.suffix == ".gguf":
        return "gguf", path  # a bad magic in a .gguf is reported by the GGUF reader
    if path.suffix == ".safetensors" or path.name == "config.json":
        raise ModelLoadError(f"{path} is one file of a model; pass the folder that contains it")
    raise ModelLoadError(f"{path} is neither a GGUF file nor a model folder")


def load_model_config(path_or_name, quiet: bool = False, download_dir=None):
    """Just the ModelConfig (cheap: reads config.json or the GGUF header; a Hugging Face id's
    weights are not fetched for it)."""
    kind, path = locate(path_or_name, quiet, download_dir, weights=False)
    if kind == "hf":
        from outpace.models.loader.safetensors import read_hf_config
        return read_hf_config(path)
    from outpace.models.loader.gguf import GGUFFile, config_from_gguf
    return config_from_gguf(GGUFFile(path))


def load_model(path_or_name, runner_cfg=None, quiet: bool = False, *, dtype=None, device=None,
               weight_dtype=None, download_dir=None, max_positions=None, tp=None,
               tokenizer: bool = True):
    """-> (model in eval mode, ModelConfig, Tokenizer).

    `path_or_name`: a catalog name, a Hugging Face folder, a .gguf file, or a Hugging Face model
    id fetched into `download_dir` (default: the Hugging Face cache). `max_positions`: the
    positions the rope tables cover, at most the model's (None: all of the model's).

    Device, dtype (activations) and weight_dtype (storage of the large matrices, see
    models/weight_dtype.py) come from `runner_cfg` (default RunnerConfig(): CPU, float32); the
    `dtype`, `weight_dtype` (torch.dtype) and `device` keywords override it (weight_dtype
    defaults to dtype then).

    `tp`: a tensor-parallel rank's share of the model (parallel/group.TensorParallel; None: the
    whole model). tokenizer=False: no tokenizer (None in its place), for ranks that only compute.
    """
    import sys

    import torch

    from outpace.models.weight_dtype import store_weights_in_
    from outpace.runner_config import RunnerConfig
    from outpace.tokenizer import Tokenizer
    runner_cfg: Optional[RunnerConfig] = runner_cfg or RunnerConfig()
    if dtype is None:
        dtype = runner_cfg.torch_dtype
        weight_dtype = weight_dtype or runner_cfg.torch_weight_dtype
    weight_dtype = weight_dtype or dtype
    device = device if device is not None else runner_cfg.device
    t0 = time.perf_counter()
    kind, path = locate(path_or_name, quiet, download_dir)
    # The tokenizer loads on a second thread while the weights load on this one: it is mostly
    # Python (importing transformers, reading its files; GIL-bound), the weights mostly torch
    # ops (which release the GIL), so on two cores the two overlap. Its eos ids come from the
    # config, read first (cheap).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="outpace-tokenizer") as pool:
        submit = pool.submit if tokenizer else (lambda *a, **k: None)
        if kind == "hf":
            from outpace.models.loader.safetensors import load_hf_folder, read_hf_config
            tok_future = submit(Tokenizer.from_folder, path, read_hf_config(path).eos_token_ids)
            model, cfg = load_hf_folder(path, dtype, device, quiet, max_positions=max_positions,
                                        tp=tp)
        else:
            from outpace.models.loader.gguf import GGUFFile, config_from_gguf, load_gguf
            g = GGUFFile(path)
            tok_future = submit(Tokenizer.from_gguf, path, config_from_gguf(g).eos_token_ids,
                                cache_key=g.metadata_sha256(), quiet=quiet)
            model, cfg, g = load_gguf(g, dtype, device, quiet, max_positions=max_positions,
                                      tp=tp)
        if weight_dtype != dtype:
            # Loaded in the activation dtype first (the loaders round once, from the file's
            # values)
            store_weights_in_(model, weight_dtype)
        if torch.device(device).type == "cpu":
            model.add_cpu_weight_copies_()
        tok = tok_future.result() if tok_future is not None else None
    if not quiet:
        dtypes = str(dtype) if weight_dtype == dtype else f"{dtype}, weights {weight_dtype}"
        # a Hugging Face id's snapshot folder is named by its commit: show the id
        shown = path.name if Path(str(path_or_name)).expanduser().exists() else path_or_name
        params = f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params"
        if tp is not None and tp.size > 1:
            params += f" on rank {tp.rank} of {tp.size}"
        print(f"outpace: loaded {shown} ({cfg.architecture}, {params}, {dtypes}) in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return model, cfg, tok
