"""The target's features for draft-head training, computed on the fly in the trainer's process.

One dense forward of the loaded target (outpace's LlamaForCausalLM parameters, no KV pool) over
a right-padded batch [B, T]: causal attention within each row, so a row's padding never reaches
its real tokens. It returns what a head learns from, and nothing goes to disk:

    aux      [B, T, n * H]  the residual stream after each captured layer, side by side
                            (EAGLE-3's fc input; the engine's `capture_layers`)
    hidden   [B, T, H]      after the final norm (MTP's h^0: what the engine hands its proposer)
    logits   [B, T, V']     the target's logits, of the columns `vocab_ids` when given
                            (EAGLE-3's draft vocabulary) or of the whole vocabulary
    argmax   [B, T]         the target's greedy token over the whole vocabulary

The arithmetic is the engine's (HF's RMSNorm, neox rope from the same inverse frequencies, fused
qkv / gate_up), in the model's dtype; tests/training checks it against the engine's paged forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from outpace.models.rotary import rope_inv_freq


@dataclass
class TargetFeatures:
    aux: Optional[torch.Tensor]
    hidden: Optional[torch.Tensor]
    logits: torch.Tensor
    argmax: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm (statistics in fp32, cast back, then the weight), differentiable."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * h.to(x.dtype)


def rope_tables(cfg, positions: torch.Tensor) -> tuple:
    """positions [...] long -> (cos, sin) [..., 1, D] fp32, rotate_half's sign folded into sin."""
    inv = rope_inv_freq(cfg).to(positions.device)
    freqs = positions.float()[..., None] * inv  # [..., D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    half = cfg.head_dim // 2
    sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return emb.cos().unsqueeze(-2), sin.unsqueeze(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, D] -> rotated, in x's dtype (the tables' fp32 products rounded once)."""
    half = x.shape[-1] // 2
    xf = x.float()
    return (xf * cos + torch.roll(xf, half, dims=-1) * sin).to(x.dtype)


def _linear(x, w, bias=None):
    return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, Hkv * groups, T, D] (grouped-query attention's sharing)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def dense_layer(layer, h: torch.Tensor, cos, sin) -> torch.Tensor:
    """One LlamaDecoderLayer over a dense batch, causal: h [B, T, H] -> [B, T, H]."""
    a, mlp = layer.self_attn, layer.mlp
    b, t = h.shape[:2]
    x = rms_norm(h, layer.input_layernorm.weight, layer.input_layernorm.eps)
    qkv = _linear(x, a.qkv_weight, a.qkv_bias).view(b, t, -1, a.head_dim)
    hq, hkv = a.num_heads, a.num_kv_heads
    q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
    if a.q_norm is not None:
        q = rms_norm(q, a.q_norm.weight, a.q_norm.eps)
        k = rms_norm(k, a.k_norm.weight, a.k_norm.eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    groups = hq // hkv
    o = F.scaled_dot_product_attention(q.transpose(1, 2), repeat_kv(k.transpose(1, 2), groups),
                                       repeat_kv(v.transpose(1, 2), groups), is_causal=True)
    o = o.transpose(1, 2).reshape(b, t, hq * a.head_dim)
    h = h + _linear(o, a.o_weight, a.o_bias)
    post = layer.post_attention_layernorm
    gu = _linear(rms_norm(h, post.weight, post.eps), mlp.gate_up_weight)
    act = F.silu(gu[..., :mlp.inter]) * gu[..., mlp.inter:]
    return h + _linear(act, mlp.down_weight)


@torch.no_grad()
def target_features(model, input_ids: torch.Tensor, capture_layers: tuple = (),
                    want_hidden: bool = False,
                    vocab_ids: Optional[torch.Tensor] = None,
                    layer_fn=dense_layer) -> TargetFeatures:
    """input_ids [B, T] long (right-padded) -> TargetFeatures (see the module docstring).
    layer_fn: dense_layer or a compiled copy of it."""
    cfg = model.config
    dtype = model.dtype
    b, t = input_ids.shape
    h = F.embedding(input_ids, model.embed_weight).to(dtype)
    positions = torch.arange(t, device=input_ids.device)
    cos, sin = rope_tables(cfg, positions)  # [T, 1, D]
    captured = {}
    for i, layer in enumerate(model.layers):
        h = layer_fn(layer, h, cos, sin)
        if i in capture_layers:
            captured[i] = h
    final = rms_norm(h, model.norm.weight, model.norm.eps)
    full = _linear(final, model.lm_head_weight)  # [B, T, V]
    argmax = full.argmax(dim=-1)
    logits = full if vocab_ids is None else full.index_select(-1, vocab_ids)
    aux = torch.cat([captured[i] for i in capture_layers], dim=-1) if capture_layers else None
    return TargetFeatures(aux=aux, hidden=final if want_hidden else None, logits=logits,
                          argmax=argmax)
