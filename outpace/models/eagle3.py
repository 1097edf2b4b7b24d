"""EAGLE-3 draft head: one decoder layer over [embedding(t[p+1]), fused target hidden(p)].

Checkpoint format (as released by the EAGLE authors, loaded by SGLang/vLLM); names below are
the tensors of model.safetensors / pytorch_model.bin:

    fc.weight                       [H, 3H]   fuses the target's 3 captured layers (aux_layer_ids)
    midlayer.input_layernorm        [H]       normalizes the token embedding
    midlayer.hidden_norm            [H]       normalizes the (fused or recurrent) hidden
    midlayer.self_attn.{q,k,v}_proj [*, 2H]   read cat[input_layernorm(emb), hidden_norm(hidden)]
    midlayer.self_attn.o_proj, post_attention_layernorm, mlp.{gate,up,down}_proj   (Llama)
    norm.weight                     [H]       before lm_head (logits only; hidden recurs pre-norm)
    lm_head.weight                  [draft_vocab, H]
    d2t                             [draft_vocab] int64: target_id = draft_id + d2t[draft_id]
    t2d                             [vocab] bool: target ids the draft vocabulary covers
    embed_tokens.weight (optional)  [vocab, H]; else the target's embedding is shared

Data flow of one draft step (row = one token of one request):

    step 0:  hidden = fc(cat(aux_1, aux_2, aux_3))      aux_i: target residual stream after layer i
    step j:  hidden = previous step's output (pre-norm)
    out = midlayer(residual=hidden, attn_in=cat[in_norm(embed(ids)), hidden_norm(hidden)])
          (config norm_before_residual=true: residual=hidden_norm(hidden), as vLLM reads it)

The layer's KV lives in the draft plane: slot `layer_slot` (>= target layers) of the target's pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from outpace.attention.base import ForwardContext
from outpace.errors import ConfigError, ModelLoadError
from outpace.kernels import embed_norm_cat
from outpace.kernels.argmax import argmax_rows
from outpace.kernels.skinny_gemm import small_linear
from outpace.model_config import ModelConfig
from outpace.models.cpu_fast_paths import linear
from outpace.models.llama import LlamaDecoderLayer, RMSNorm
from outpace.models.rotary import RotaryEmbedding
from outpace.models.weight_dtype import upcast_linear
from outpace.parallel.group import SINGLE, TensorParallel


def side_by_side(parts: list) -> Optional[torch.Tensor]:
    """The [T, n * H] tensor whose column blocks are `parts` (n [T, H] views, in order) when
    they are exactly that (the few-row target's captured layers), else None."""
    first = parts[0]
    if first.dim() != 2:
        return None
    t, h = first.shape
    n, size = len(parts), first.element_size()
    if first.stride() != (n * h, 1):
        return None
    for j, p in enumerate(parts):
        if (p.shape != first.shape or p.stride() != first.stride() or p.dtype != first.dtype
                or p.device != first.device
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or p.data_ptr() != first.data_ptr() + j * h * size):
            return None
    return first.as_strided((t, n * h), (n * h, 1))


def default_aux_layer_ids(num_target_layers: int) -> tuple:
    """(1, L/2-1, L-4): low, middle and late features, as EAGLE-3 trains them by default."""
    n = num_target_layers
    return (1, n // 2 - 1, n - 4)


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # shape and rope of the midlayer (architecture 'llama'); vocab = target's
    draft_vocab_size: int
    target_num_hidden_layers: int
    aux_layer_ids: Optional[tuple] = None  # None: default_aux_layer_ids(target layers)
    has_embedding: bool = False  # the checkpoint carries its own embed_tokens
    norm_before_residual: bool = False  # residual = hidden_norm(hidden) (some trainers' variant)

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def resolved_aux_layer_ids(self) -> tuple:
        if self.aux_layer_ids is not None:
            return tuple(int(i) for i in self.aux_layer_ids)
        return default_aux_layer_ids(self.target_num_hidden_layers)

    @staticmethod
    def from_hf_dict(d: dict, target_num_hidden_layers: int,
                     has_embedding: bool = False) -> "Eagle3Config":
        """Parse an EAGLE-3 config.json dict. Raises ModelLoadError when a field is missing."""
        for key in ("hidden_size", "num_attention_heads", "vocab_size"):
            if key not in d:
                raise ModelLoadError(f"the EAGLE-3 config.json lacks {key!r}; it is not an "
                                     f"EAGLE-3 head config (expected a LlamaConfig-like dict)")
        h = dict(d)
        # The midlayer is always a Llama layer, whatever the target family is.
        h["model_type"], h["architectures"] = "llama", ["LlamaForCausalLM"]
        h.setdefault("intermediate_size", 4 * h["hidden_size"])
        h["num_hidden_layers"] = 1
        try:
            layer = ModelConfig.from_hf_dict(h)
        except ConfigError as e:
            raise ModelLoadError(f"invalid EAGLE-3 config.json: {e}") from e
        if int(d.get("num_hidden_layers", 1)) != 1:
            raise ModelLoadError(f"EAGLE-3 heads with num_hidden_layers="
                                 f"{d['num_hidden_layers']} are not supported; outpace runs "
                                 f"the single-layer EAGLE-3 head")
        eagle = d.get("eagle_config") or {}
        if not eagle.get("use_aux_hidden_state", True):
            raise ModelLoadError("EAGLE-3 heads with eagle_config.use_aux_hidden_state=false "
                                 "(no fc fusion) are not supported")
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        return Eagle3Config(layer=layer,
                            draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
                            target_num_hidden_layers=target_num_hidden_layers,
                            aux_layer_ids=tuple(int(i) for i in aux) if aux else None,
                            has_embedding=has_embedding,
                            norm_before_residual=bool(d.get("norm_before_residual", False)))


def _param(*shape, dtype, device) -> nn.Parameter:
    # Uninitialized: the loader (or init-draft) fills every parameter.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))


class Eagle3Head(nn.Module):
    num_kv_layers = 1  # KV slots of the draft plane this head uses

    def __init__(self, cfg: Eagle3Config, layer_slot: int, dtype=torch.float32, device="cpu",
                 max_positions: Optional[int] = None, tp: TensorParallel = SINGLE):
        # max_positions: the positions the rope tables cover (None: the config's; rotary.py).
        # tp: a tensor-parallel rank's share: its decoder layer sharded as the target's are;
        # fc, the norms, its LM head and its embedding whole on every rank (vLLM's choice)
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        lc = cfg.layer
        h = lc.hidden_size
        self.config = cfg
        self.layer_slot = layer_slot
        self.aux_layer_ids = cfg.resolved_aux_layer_ids
        self.fc_weight = _param(h, 3 * h, **kw)
        self.hidden_norm = RMSNorm(h, lc.rms_norm_eps, **kw)
        self.midlayer = LlamaDecoderLayer(lc, layer_slot, qkv_input_size=2 * h, **kw, tp=tp)
        self.norm = RMSNorm(h, lc.rms_norm_eps, **kw)
        self.lm_head_weight = _param(cfg.draft_vocab_size, h, **kw)
        self.embed_weight = _param(lc.vocab_size, h, **kw) if cfg.has_embedding else None
        self.rotary = RotaryEmbedding(lc, **kw, max_positions=max_positions)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64,
                                                device=device))
        self.register_buffer("t2d", torch.ones(lc.vocab_size, dtype=torch.bool, device=device))

    @property
    def has_own_embedding(self) -> bool:
        return self.embed_weight is not None

    def fuse(self, aux: list) -> torch.Tensor:
        # 3 x [T, H] (target residual stream after each aux layer) -> [T, H]; few rows (a
        # verify block) take the few-row kernel (faster than cuBLAS at H = 576), more the
        # reference: upcast_linear's F.linear. The few-row target writes the three side by
        # side already (no concatenation kernel then).
        joined = side_by_side(aux)
        x = joined if joined is not None else torch.cat(aux, dim=-1)
        if x.is_cuda:
            return small_linear(x, self.fc_weight)
        return linear(x, self, "fc_weight")  # CPU: the fast weight copies, where there are

    def embed(self, input_ids: torch.Tensor,
              embed_fn: Optional[Callable] = None) -> torch.Tensor:
        # [T] long -> [T, H]; the head's own table wins over the shared one (its rows come in
        # the table's dtype, which may be narrower than the activations: forward casts them)
        if self.embed_weight is not None:
            return F.embedding(input_ids, self.embed_weight)
        if embed_fn is None:
            raise ValueError("this EAGLE-3 head has no embed_tokens; pass the target's embed_fn")
        return embed_fn(input_ids)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext, embed_fn: Optional[Callable] = None,
                embed_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        # hidden [T, H] (fuse() output or the previous step's output), input_ids [T] (token at
        # position + 1), positions [T] -> new hidden [T, H], pre-norm: the one that recurs.
        # embed_weight: the table embed_fn gathers from, when its rows cast to hidden's dtype
        # are embed_fn's values (the proposer checks); it lets CUDA run the gather, both norms
        # and the concatenation as one kernel (kernels/embed_norm_cat.py)
        table = self.embed_weight if self.embed_weight is not None else embed_weight
        in_norm = self.midlayer.input_layernorm
        attn_in = embed_norm_cat.fused_head_input(input_ids, table, in_norm, hidden,
                                              self.hidden_norm)  # [T, 2H] or None
        if attn_in is not None:
            normed = attn_in[:, hidden.shape[-1]:]  # a view: hidden_norm(hidden)
        else:
            emb = self.embed(input_ids, embed_fn).to(hidden.dtype)
            normed = self.hidden_norm(hidden)
            attn_in = torch.cat([in_norm(emb), normed], dim=-1)  # [T, 2H]
        residual = normed if self.config.norm_before_residual else hidden
        cos_sin = self.rotary(positions)
        layer = self.midlayer
        if layer.takes_few_rows(hidden):
            # draft steps have few rows: the target's few-row kernels (fused residual adds and
            # post-attention norm) instead of cuBLAS and separate norms
            return layer.forward_few_rows(residual, cos_sin, self.rotary, ctx, attn_input=attn_in)
        return layer(residual, cos_sin, self.rotary, ctx, attn_input=attn_in)

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # [N, H] (forward output) -> [N, draft_vocab] float32
        return upcast_linear(self.norm(hidden), self.lm_head_weight).float()

    def greedy_draft_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        # [N, H] -> [N] draft-vocab ids, argmax of compute_draft_logits (in the model's dtype:
        # the same argmax without the fp32 conversion)
        return argmax_rows(upcast_linear(self.norm(hidden), self.lm_head_weight))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        # [...] draft-vocab ids -> [...] target-vocab ids
        return draft_ids + self.d2t[draft_ids]

    def greedy_target_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        # [N, H] -> [N] target-vocab ids: draft_to_target(greedy_draft_ids(hidden))
        return self.greedy_target_ids_normed(self.norm(hidden))

    def greedy_target_ids_normed(self, normed: torch.Tensor, also: tuple = ()) -> torch.Tensor:
        # the same from norm(hidden), with d2t added inside the argmax kernel (and the ids
        # also written into `also`: argmax_rows). linear: upcast_linear, or on CPU the fast
        # weight copies that load_draft_head adds (cpu_fast_paths.add_weight_copies_)
        return argmax_rows(linear(normed, self, "lm_head_weight"), offsets=self.d2t,
                           also=also)
