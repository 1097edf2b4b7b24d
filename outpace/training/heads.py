"""Trainable draft heads: new ones for a target (random, warm-started from the target's own
weights where a head shares their role) and their export in the format the engine loads.

Warm starts: an EAGLE-3 head's LM head starts as the target's LM head rows of its draft
vocabulary and its final norm as the target's (the head's output is read the way the target's
last hidden is); an MTP module's decoder layer starts as a copy of the target's last layer. The
rest is init-draft's random initialisation (training/init_draft.py).

Export: EAGLE-3 in the public checkpoint format (config.json with `LlamaForCausalLMEagle3`,
`draft_vocab_size` and the aux layer ids; tensors fc, midlayer.*, norm, lm_head, d2t, t2d;
model.safetensors), which SGLang and vLLM load too; MTP in the format models/draft_loader.py
reads (`layers.{d}.*`, `num_nextn_predict_layers`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from outpace.errors import ConfigError
from outpace.models.draft_loader import (eagle3_config_dict, export_weights, head_slices,
                                         mtp_config_dict, save_draft_head)
from outpace.models.eagle3 import Eagle3Head
from outpace.models.mtp import MTPHead
from outpace.training.draft_vocab import draft_ids_of
from outpace.training.init_draft import eagle3_config_for, random_head_tensors


def fill_head_(head, tensors: dict) -> None:
    """Copy {checkpoint name: tensor} into the head's (fused) parameters and buffers."""
    with torch.no_grad():
        for name, (dest, off, rows) in head_slices(head).items():
            dest.narrow(0, off, rows).copy_(tensors[name])


def new_eagle3_head(target, target_cfg, d2t: torch.Tensor, t2d: torch.Tensor, seed: int,
                    device, warm_start: bool = True, aux_layer_ids=None) -> Eagle3Head:
    """An fp32 EAGLE-3 head over the draft vocabulary (d2t, t2d) for `target`, fusing the
    output of target layers `aux_layer_ids` (None: the default ones)."""
    cfg = eagle3_config_for(target_cfg, d2t.numel(), aux_layer_ids)
    head = Eagle3Head(cfg, target_cfg.num_hidden_layers, dtype=torch.float32, device=device)
    tensors = random_head_tensors(head, seed)
    tensors["d2t"], tensors["t2d"] = d2t.cpu(), t2d.cpu()
    if warm_start:
        ids = draft_ids_of(d2t.cpu()).to(target.lm_head_weight.device)
        tensors["lm_head.weight"] = target.lm_head_weight.index_select(0, ids).float().cpu()
        tensors["norm.weight"] = target.norm.weight.float().cpu()
    fill_head_(head, tensors)
    return head


def new_mtp_head(target, target_cfg, num_modules: int, seed: int, device,
                 warm_start: bool = True, shared_head_norm: bool = False) -> MTPHead:
    """An fp32 MTP head of `num_modules` modules shaped like the target's layers;
    shared_head_norm: each module with its own final norm (a head continued from a
    DeepSeek-layout checkpoint; new heads read the target's)."""
    head = MTPHead(target_cfg, num_modules, target_cfg.num_hidden_layers, dtype=torch.float32,
                   device=device, shared_head_norm=shared_head_norm)
    tensors = random_head_tensors(head, seed)
    if warm_start:
        last = len(target.layers) - 1
        src = {name[len(f"model.layers.{last}."):]: (t, off, rows)
               for name, (t, off, rows, *_) in target.param_slices().items()
               if name.startswith(f"model.layers.{last}.")}
        for d in range(num_modules):
            for rest, (t, off, rows) in src.items():
                tensors[f"layers.{d}.{rest}"] = t.detach().narrow(0, off, rows).float().cpu()
    fill_head_(head, tensors)
    return head


def head_from_export(method: str, path, target, target_cfg, device):
    """A trainable fp32 head holding the exported head at `path` (what `export_head` or a
    released checkpoint wrote): its weights, and for EAGLE-3 its draft vocabulary and aux
    layers, so training continues from it. Raises ModelLoadError / ConfigError as the engine's
    loader does when the folder does not fit the target."""
    from outpace.models.draft_loader import load_draft_head
    loaded = load_draft_head(method, Path(path).expanduser(), target_cfg,
                             target_cfg.num_hidden_layers, dtype=torch.float32, device="cpu")
    tensors = export_weights(loaded)
    if method == "eagle3":
        head = new_eagle3_head(target, target_cfg, loaded.d2t.cpu(), loaded.t2d.cpu(), 0, device,
                               False, tuple(loaded.aux_layer_ids))
    else:
        head = new_mtp_head(target, target_cfg, loaded.num_modules, 0, device, False,
                            shared_head_norm=loaded.has_shared_head_norm)
    if head.config != loaded.config:
        mine, theirs = dataclasses.asdict(head.config), dataclasses.asdict(loaded.config)
        diff = sorted(k for k in mine if mine[k] != theirs.get(k))
        raise ConfigError(f"--init-head {path}: train-draft trains heads shaped like the "
                          f"target's layers, and this head differs in {', '.join(diff[:6])}; "
                          f"start a new head instead")
    fill_head_(head, {n: t.float() if t.is_floating_point() else t for n, t in tensors.items()})
    return head


def grow_eagle3_head(head: Eagle3Head, target, target_cfg, d2t: torch.Tensor,
                     t2d: torch.Tensor, device, warm_start: bool = True,
                     seed: int = 0) -> Eagle3Head:
    """`head` over a larger draft vocabulary (d2t, t2d) that holds all of its ids
    (`draft_vocab.grow_draft_vocab`): every tensor and every trained LM head row kept. The added
    ids' rows (warm_start) are the target's LM head rows mapped as training mapped the kept
    ones: a * row + b, a the median per-row least-squares scale and b the mean remainder of
    the head's rows against the target's rows of the same ids (the target's rows as they are
    outscore the trained ones, and the head would propose the added ids nearly everywhere);
    else random."""
    old_ids = draft_ids_of(head.d2t.cpu())
    new_ids = draft_ids_of(d2t.cpu())
    pos = torch.searchsorted(new_ids, old_ids)
    if pos.max() >= new_ids.numel() or not torch.equal(new_ids[pos], old_ids):
        raise ConfigError("the grown draft vocabulary must hold every id of the head's "
                          "(its d2t)")
    grown = new_eagle3_head(target, target_cfg, d2t, t2d, seed, device, warm_start,
                            tuple(head.aux_layer_ids))
    tensors = {n: t.float() if t.is_floating_point() else t
               for n, t in export_weights(head).items()}
    lm = export_weights(grown)["lm_head.weight"].float()
    if warm_start:
        trained = tensors["lm_head.weight"]
        own = target.lm_head_weight.detach().index_select(
            0, old_ids.to(target.lm_head_weight.device)).float().cpu()
        scale = ((trained * own).sum(1) / (own * own).sum(1).clamp_min(1e-12)).median()
        shift = (trained - scale * own).mean(0)
        lm = scale * lm + shift
    lm[pos] = tensors["lm_head.weight"]
    tensors.update({"lm_head.weight": lm, "d2t": d2t.cpu(), "t2d": t2d.cpu()})
    fill_head_(grown, tensors)
    return grown


def export_head(head, out_dir, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the head as a draft head folder (config.json + model.safetensors), its floating
    tensors in `dtype` (d2t int64, t2d bool)."""
    if isinstance(head, Eagle3Head):
        config = eagle3_config_dict(head.config)
    else:
        config = mtp_config_dict(head.config, head.num_modules)
    config["torch_dtype"] = str(dtype).replace("torch.", "")
    tensors = {n: (t.to(dtype) if t.is_floating_point() else t)
               for n, t in export_weights(head).items()}
    return save_draft_head(config, tensors, out_dir)
