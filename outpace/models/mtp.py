"""MTP (multi-token prediction) draft modules, DeepSeek-V3 style.

Module d (weights `layers.{d}.*` in the checkpoint):

    x   = eh_proj(cat[enorm(embed(t[p+1])), hnorm(h[p])])      eh_proj: [H, 2H]
    out = decoder_layer_d(x)                                      same architecture as the target
    logits = target.lm_head(norm_d(out))                          the LM head is the target's

`norm_d` is the module's own final norm (`layers.{d}.shared_head.norm.weight`, as DeepSeek-V3's
checkpoints have it) when the checkpoint has one, else the target's final norm (outpace's own
MTP heads: docs/decisions.md, "MTP logits through the module's shared_head.norm").

`h[p]` is the target's hidden (first depth) or the previous depth's `out` (later depths). The
proposer picks the schedule: one module applied k times ("MTP-Eagle"), or the D modules in order
(depth d uses module d). Module d keeps its KV in draft-plane slot `first_layer_slot + d` of the
target's pool. The embedding and LM head (and the final norm of a head without its own) are the
target's, passed in at call time, so the head holds no vocabulary-sized tensor.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from outpace.attention.base import ForwardContext
from outpace.kernels import embed_norm_cat
from outpace.model_config import ModelConfig
from outpace.models.cpu_fast_paths import linear
from outpace.models.llama import LlamaDecoderLayer, RMSNorm
from outpace.models.rotary import RotaryEmbedding
from outpace.parallel.group import SINGLE, TensorParallel


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_slot: int, dtype=torch.float32, device="cpu",
                 shared_head_norm: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, **kw)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, **kw)
        # Uninitialized: the loader (or init-draft) fills it.
        self.eh_proj_weight = nn.Parameter(torch.empty(h, 2 * h, **kw))
        self.layer = LlamaDecoderLayer(cfg, layer_slot, **kw, tp=tp)
        # The module's own final norm before the (shared) LM head; None: the target's
        self.shared_head_norm = RMSNorm(h, cfg.rms_norm_eps, **kw) if shared_head_norm else None


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, num_modules: int, first_layer_slot: int,
                 dtype=torch.float32, device="cpu", max_positions: Optional[int] = None,
                 shared_head_norm: bool = False, tp: TensorParallel = SINGLE):
        # max_positions: the positions the rope tables cover (None: the config's; rotary.py);
        # shared_head_norm: every module has its own final norm (a DeepSeek-layout checkpoint);
        # tp: a tensor-parallel rank's share: each module's decoder layer sharded as the
        # target's are, its norms and eh_proj whole (the LM head is the target's, sharded)
        super().__init__()
        if num_modules < 1:
            raise ValueError(f"an MTP head needs >= 1 module, got {num_modules}")
        self.config = cfg
        self.num_modules = num_modules
        self.first_layer_slot = first_layer_slot
        self.has_shared_head_norm = shared_head_norm
        self.layers = nn.ModuleList(
            MTPModule(cfg, first_layer_slot + d, dtype=dtype, device=device,
                      shared_head_norm=shared_head_norm, tp=tp)
            for d in range(num_modules))
        self.rotary = RotaryEmbedding(cfg, dtype=dtype, device=device,
                                      max_positions=max_positions)

    @property
    def num_kv_layers(self) -> int:  # KV slots of the draft plane this head uses
        return self.num_modules

    def forward(self, depth: int, hidden: torch.Tensor, input_ids: torch.Tensor,
                positions: torch.Tensor, ctx: ForwardContext, embed_fn: Callable,
                embed_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        # depth: which module runs; hidden [T, H] (target hidden or previous depth's output),
        # input_ids [T] (token at position + 1), positions [T] -> new hidden [T, H] (pre-norm).
        # embed_weight: the table embed_fn gathers from, when its rows cast to hidden's dtype
        # are embed_fn's values (the proposer checks); it lets CUDA run the gather, both norms
        # and the concatenation as one kernel (kernels/embed_norm_cat.py)
        m = self.layers[depth]
        x_in = embed_norm_cat.fused_head_input(input_ids, embed_weight, m.enorm, hidden, m.hnorm)
        if x_in is None:
            emb = embed_fn(input_ids).to(hidden.dtype)
            x_in = torch.cat([m.enorm(emb), m.hnorm(hidden)], dim=-1)
        x = linear(x_in, m, "eh_proj_weight")  # upcast_linear, or a CPU fast copy
        cos_sin = self.rotary(positions)
        if m.layer.takes_few_rows(x):
            # draft steps have few rows: the target's few-row kernels (norms fused into the
            # projections) instead of cuBLAS and separate norms; x is the layer's residual input
            return m.layer.forward_few_rows(x, cos_sin, self.rotary, ctx)
        return m.layer(x, cos_sin, self.rotary, ctx)

    def final_norm(self, depth: int, target) -> RMSNorm:
        """The norm between module `depth`'s output and the LM head: its own shared_head.norm
        when the checkpoint has one, else the target's final norm."""
        own = self.layers[depth].shared_head_norm
        return target.norm if own is None else own

    def compute_logits(self, hidden: torch.Tensor, target, depth: int = 0) -> torch.Tensor:
        # [N, H] (module `depth`'s output) -> [N, vocab] float32, through that module's final
        # norm (final_norm) and the target's LM head
        return target.compute_logits(self.final_norm(depth, target)(hidden))
