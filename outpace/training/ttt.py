"""Training-time test (TTT): a draft head unrolled over S steps on a dense batch, as it drafts.

Row p of a batch [B, T] is the chain anchored at p, the way the engine drafts from a frontier
(speculative/head_proposer.py): step 0 reads the target's features at p and the token at p + 1; step i
reads the head's own output of step i - 1 (its hidden, fed back) and the token at p + 1 + i, and
predicts the token at p + 2 + i. In the engine that row sits at position p + i, and its
attention sees the KV plane as the draft loop leaves it:

    keys of step 0 at positions <= p   (exact entries: the first pass over target rows)
    keys of step j at position p + j   for 1 <= j <= i  (the chain's own earlier steps)

so TTT's mask is causal over step 0's keys and diagonal over every later step's ("chain" mode),
with rope at p + i. MTP's depths mode (speculative/mtp_window.py) is another geometry: module d runs
over a whole window at positions p, attending causally to its own depth's keys ("depths" mode).
tests/training/test_ttt.py checks both against the inference heads run step by step over a
paged KV pool.

The layers here are functional views of the inference modules (models/eagle3.py, models/mtp.py):
the same parameters, differentiable dense arithmetic, so what trains is what the engine loads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from outpace.training.target_features import (_linear, apply_rope, repeat_kv, rms_norm,
                                              rope_tables)

CHAIN, DEPTHS = "chain", "depths"


def shift(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x [B, T, ...] -> y with y[:, p] = x[:, p + n] (fill past the end)."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1])) + tuple(x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diag_k, diag_v,
                  mode: str) -> torch.Tensor:
    """q [B, Hq, T, D] (rotated) of step i over step 0's keys and values k0, v0 [B, Hq, T, D]
    and the later steps' diag_k, diag_v [B, Hq, T, i, D] (None at step 0; grouped heads already
    repeated) -> [B, Hq, T, D].

    chain: causal over k0, diagonal over diag_k (row p sees each later step's key at p);
    depths: causal over k0 alone (each module its own keys). The later steps' keys are one
    tensor, not a list, so that a compiled step is one graph for every i >= 2."""
    if mode == DEPTHS or diag_k is None:
        return F.scaled_dot_product_attention(q, k0, v0, is_causal=True)
    scale = q.shape[-1] ** -0.5
    t = q.shape[2]
    s0 = torch.matmul(q, k0.transpose(-1, -2)).float() * scale  # [B, H, T, T]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = (q.unsqueeze(-2) * diag_k).sum(-1).float() * scale  # [B, H, T, i]
    p = torch.softmax(torch.cat([s0, diag], dim=-1), dim=-1)
    p0, pd = p[..., :t].to(q.dtype), p[..., t:].to(q.dtype)
    return torch.matmul(p0, v0) + (pd.unsqueeze(-1) * diag_v).sum(-2)


class LayerCache:
    """The keys and values each step of one layer wrote, for the later steps' attention: step
    0's [B, H, T, D], the later steps' stacked [B, H, T, i, D]."""

    def __init__(self):
        self.k0 = self.v0 = self.diag_k = self.diag_v = None

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.k0 is None:
            self.k0, self.v0 = k, v
        elif self.diag_k is None:
            self.diag_k, self.diag_v = k.unsqueeze(-2), v.unsqueeze(-2)
        else:
            self.diag_k = torch.cat([self.diag_k, k.unsqueeze(-2)], dim=-2)
            self.diag_v = torch.cat([self.diag_v, v.unsqueeze(-2)], dim=-2)


def layer_step(layer, rope_cfg, attn_in: torch.Tensor, residual: torch.Tensor,
               positions: torch.Tensor, cache: LayerCache, mode: str) -> torch.Tensor:
    """One LlamaDecoderLayer step: attn_in [B, T, in] (already normalized), residual [B, T, H],
    positions [T] -> the layer's output [B, T, H] (the new residual stream). rope_cfg: the
    ModelConfig whose rope the layer uses."""
    a, mlp = layer.self_attn, layer.mlp
    b, t = attn_in.shape[:2]
    qkv = _linear(attn_in, a.qkv_weight, a.qkv_bias).view(b, t, -1, a.head_dim)
    hq, hkv = a.num_heads, a.num_kv_heads
    q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
    if a.q_norm is not None:
        q = rms_norm(q, a.q_norm.weight, a.q_norm.eps)
        k = rms_norm(k, a.k_norm.weight, a.k_norm.eps)
    cos, sin = rope_tables(rope_cfg, positions)  # [T, 1, D]: the same for every row
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    groups = hq // hkv
    cache.add(repeat_kv(k.transpose(1, 2), groups), repeat_kv(v.transpose(1, 2), groups))
    o = ttt_attention(q.transpose(1, 2), cache.k0, cache.v0, cache.diag_k, cache.diag_v, mode)
    o = o.transpose(1, 2).reshape(b, t, hq * a.head_dim)
    h = residual + _linear(o, a.o_weight, a.o_bias)
    post = layer.post_attention_layernorm
    gu = _linear(rms_norm(h, post.weight, post.eps), mlp.gate_up_weight)
    act = F.silu(gu[..., :mlp.inter]) * gu[..., mlp.inter:]
    return h + _linear(act, mlp.down_weight)


class Eagle3Unroll:
    """EAGLE-3's TTT over an Eagle3Head: fc, then the midlayer S times, chain mode."""

    mode = CHAIN

    def __init__(self, head, embed_weight: torch.Tensor):
        self.head = head
        self.embed_weight = embed_weight  # the target's (frozen) when the head has none

    def first_hidden(self, aux: torch.Tensor) -> torch.Tensor:
        return _linear(aux, self.head.fc_weight)  # [B, T, 3H] -> [B, T, H]

    def step(self, i: int, hidden, tokens, positions, cache: LayerCache):
        head = self.head
        table = head.embed_weight if head.embed_weight is not None else self.embed_weight
        emb = F.embedding(tokens, table).to(hidden.dtype)
        ln = head.midlayer.input_layernorm
        normed = rms_norm(hidden, head.hidden_norm.weight, head.hidden_norm.eps)
        attn_in = torch.cat([rms_norm(emb, ln.weight, ln.eps), normed], dim=-1)
        residual = normed if head.config.norm_before_residual else hidden
        return layer_step(head.midlayer, head.config.layer, attn_in, residual, positions, cache,
                          self.mode)

    def logits(self, hidden: torch.Tensor, i: int = 0) -> torch.Tensor:
        # step i's output -> logits (every step reads the head's one norm and LM head)
        n = self.head.norm
        return _linear(rms_norm(hidden, n.weight, n.eps), self.head.lm_head_weight)

    def caches(self) -> list:
        return [LayerCache()]


class MTPUnroll:
    """MTP's TTT over an MTPHead: module 0 applied S times (chain mode, the engine's 'eagle'
    MTP mode) or module d at step d (depths mode). The target's embedding and LM head are
    shared and frozen, its final norm too unless the modules have their own (a head continued
    from a DeepSeek-layout checkpoint: `shared_head.norm`, trained with the rest)."""

    def __init__(self, head, target, mode: str):
        if mode not in (CHAIN, DEPTHS):
            raise ValueError(f"MTP TTT mode must be {CHAIN!r} or {DEPTHS!r}, got {mode!r}")
        self.head, self.target, self.mode = head, target, mode

    def first_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # the target's final-normed hidden: what the engine hands the proposer

    def module(self, i: int):
        return self.head.layers[i if self.mode == DEPTHS else 0]

    def step(self, i: int, hidden, tokens, positions, cache: LayerCache):
        m = self.module(i)
        emb = F.embedding(tokens, self.target.embed_weight).to(hidden.dtype)
        x_in = torch.cat([rms_norm(emb, m.enorm.weight, m.enorm.eps),
                          rms_norm(hidden, m.hnorm.weight, m.hnorm.eps)], dim=-1)
        x = _linear(x_in, m.eh_proj_weight)
        ln = m.layer.input_layernorm
        return layer_step(m.layer, self.head.config, rms_norm(x, ln.weight, ln.eps), x,
                          positions, cache, self.mode)

    def logits(self, hidden: torch.Tensor, i: int = 0) -> torch.Tensor:
        # step i's output -> logits through the norm the engine reads it with (MTPHead.final_norm)
        own = self.module(i).shared_head_norm
        n = self.target.norm if own is None else own
        return _linear(rms_norm(hidden, n.weight, n.eps), self.target.lm_head_weight)

    def caches(self) -> list:
        # chain: one KV plane across steps; depths: each module its own (a fresh cache a step)
        return [LayerCache()] if self.mode == CHAIN else None


def unroll(model, first: torch.Tensor, input_ids: torch.Tensor, steps: int, step_fn=None):
    """Run `model` (Eagle3Unroll / MTPUnroll) S = steps times from its first hidden `first`
    [B, T, H] over input_ids [B, T]. Yields (i, hidden [B, T, H]) per step: row p of step i
    predicts the token at p + 2 + i. step_fn: model.step (the default) or a compiled copy."""
    step_fn = model.step if step_fn is None else step_fn
    t = input_ids.shape[1]
    base = torch.arange(t, device=input_ids.device)
    shared = model.caches()
    hidden = first
    for i in range(steps):
        tokens = shift(input_ids, 1 + i)
        positions = base + i if model.mode == CHAIN else base
        cache = shared[0] if shared is not None else LayerCache()
        hidden = step_fn(i, hidden, tokens, positions, cache)
        yield i, hidden
