"""`outpace init-draft`: write a randomly initialised EAGLE-3 or MTP head shaped for a target.

The result is a draft head folder (config.json + model.safetensors) that `load_draft_head`
loads: the starting point for training, and a shape-correct head for wiring tests (a random
head proposes junk, which speculative decoding must still turn into the target's exact output).

Initialisation is deterministic from the seed: tensors are drawn in sorted name order from one
generator, linears ~ normal(0, 0.02), norms = 1, biases = 0. Files are float32 (training master
weights); loading casts to the engine's dtype.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Union

import torch

from outpace.errors import ConfigError
from outpace.model_config import ModelConfig
from outpace.models.draft_loader import (DRAFT_METHODS, eagle3_config_dict, head_slices,
                                         mtp_config_dict, save_draft_head)
from outpace.models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids
from outpace.models.mtp import MTPHead

INIT_STD = 0.02


def eagle3_config_for(target_cfg: ModelConfig, draft_vocab_size: Optional[int] = None,
                      aux_layer_ids: Optional[tuple] = None) -> Eagle3Config:
    """An EAGLE-3 head shaped like one target layer, reading `aux_layer_ids` (the output of
    those target layers; None: the default ones)."""
    v, n = target_cfg.vocab_size, target_cfg.num_hidden_layers
    dv = v if draft_vocab_size is None else int(draft_vocab_size)
    if not 1 <= dv <= v:
        raise ConfigError(f"draft_vocab_size must be in 1..{v} (the target vocabulary), got {dv}")
    if aux_layer_ids is not None:
        aux = tuple(int(i) for i in aux_layer_ids)
        if len(aux) != 3 or not all(0 <= i < n for i in aux):
            raise ConfigError(f"aux layers {list(aux)}: an EAGLE-3 head fuses 3 of the "
                              f"target's {n} layers, each in 0..{n - 1}")
    else:
        # Shallow targets (< 4 layers) can't have (1, L/2-1, L-4): clamp into range, written
        # out explicitly in config.json so the loader reads the same ids.
        aux = tuple(min(max(i, 0), n - 1) for i in default_aux_layer_ids(n))
    layer = ModelConfig(
        architecture="llama", vocab_size=v, hidden_size=target_cfg.hidden_size,
        intermediate_size=target_cfg.intermediate_size, num_hidden_layers=1,
        num_attention_heads=target_cfg.num_attention_heads,
        num_key_value_heads=target_cfg.num_key_value_heads, head_dim=target_cfg.head_dim,
        rms_norm_eps=target_cfg.rms_norm_eps, rope_theta=target_cfg.rope_theta,
        rope_scaling=target_cfg.rope_scaling,
        max_position_embeddings=target_cfg.max_position_embeddings,
        bos_token_id=target_cfg.bos_token_id, eos_token_ids=target_cfg.eos_token_ids)
    return Eagle3Config(layer=layer, draft_vocab_size=dv, target_num_hidden_layers=n,
                        aux_layer_ids=aux)


def random_head_tensors(head, seed: int = 0) -> dict:
    """{checkpoint name: float32 CPU tensor} for every tensor of `head` (may live on 'meta')."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (dest, _, rows) in sorted(head_slices(head).items()):
        shape = (rows,) + tuple(dest.shape[1:])
        if name == "d2t":
            # Draft id i -> target id i: the first N target ids (tokenizers put frequent
            # tokens first often enough for a head that training will replace anyway).
            out[name] = torch.zeros(shape, dtype=torch.int64)
        elif name == "t2d":
            t2d = torch.zeros(shape, dtype=torch.bool)
            t2d[:head.config.draft_vocab_size] = True
            out[name] = t2d
        elif name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shape)
        else:
            out[name] = torch.normal(0.0, INIT_STD, shape, generator=g)
    return out


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; pass a folder for the draft head")
    if (out / "model.safetensors").exists() or (out / "config.json").exists():
        raise ConfigError(f"--out {out} already holds a draft head (config.json or "
                          f"model.safetensors); choose another folder or remove it first")
    if out.is_dir():
        stale = [p.name for p in sorted(out.glob("*.safetensors")) + sorted(out.glob("*.bin"))
                 if p.name != "model.safetensors"]
        if stale:
            raise ConfigError(f"--out {out} already holds other weight files ({', '.join(stale)}) "
                              f"that would be loaded with the new head; choose an empty folder")


def init_draft(method: str, target: str, out_dir: Union[str, Path], seed: int = 0,
               quiet: bool = False, num_layers: int = 1,
               draft_vocab_size: Optional[int] = None) -> Path:
    """Write a random `method` ('eagle3' | 'mtp') head for `target` (catalog name, HF folder or
    .gguf) into out_dir. num_layers: MTP modules (EAGLE-3 has exactly one layer).
    draft_vocab_size (EAGLE-3 only): None = the target's vocabulary, else its first N ids."""
    from outpace.models.loader import load_model_config
    if method not in DRAFT_METHODS:
        raise ConfigError(f"--method {method!r} is unknown; use one of {', '.join(DRAFT_METHODS)}")
    out = Path(out_dir).expanduser()
    _check_out_dir(out)
    target_cfg = load_model_config(target, quiet=quiet)
    slot = target_cfg.num_hidden_layers  # where the runner puts the draft plane
    if method == "eagle3":
        if num_layers != 1:
            raise ConfigError(f"an EAGLE-3 head has exactly one decoder layer; --num-layers "
                              f"{num_layers} applies to MTP only (drop it or pass 1)")
        cfg = eagle3_config_for(target_cfg, draft_vocab_size)
        head = Eagle3Head(cfg, slot, device="meta")  # shapes only: no memory, no init
        config = eagle3_config_dict(cfg)
        what = f"EAGLE-3 head (aux layers {list(cfg.resolved_aux_layer_ids)}, draft vocab " \
               f"{cfg.draft_vocab_size})"
    else:
        if num_layers < 1:
            raise ConfigError(f"--num-layers must be >= 1 (MTP modules), got {num_layers}")
        if draft_vocab_size is not None:
            raise ConfigError("draft_vocab_size applies to EAGLE-3 only; MTP heads share the "
                              "target's LM head")
        head = MTPHead(target_cfg, num_layers, slot, device="meta")
        config = mtp_config_dict(target_cfg, num_layers)
        what = f"MTP head ({num_layers} module{'s' if num_layers > 1 else ''})"
    tensors = random_head_tensors(head, seed)
    save_draft_head(config, tensors, out)
    if not quiet:
        n = sum(t.numel() for t in tensors.values() if t.is_floating_point())
        print(f"outpace: wrote a random {what} for {target} ({n / 1e6:.1f}M params, seed "
              f"{seed}) to {out}", file=sys.stderr)
    return out
