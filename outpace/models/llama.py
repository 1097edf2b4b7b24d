"""One decoder for the Llama family: Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2.

The switches, all read from ModelConfig:
  attention_bias / qwen2   bias on q, k, v (and on o_proj for Llama/Qwen3 with attention_bias)
  qk_norm (Qwen3)          RMSNorm over each head of q and k, before rope
  tie_word_embeddings      lm_head is the embedding matrix (SmolLM2)
  rope_scaling             llama3, linear, or GGUF per-frequency factors

Tokens of all sequences are packed flat ([T] ids, [T] positions; no batch dim); attention and the
paged KV pool live behind `ctx.backend`. q/k/v and gate/up are each one fused matmul, because on
CPU the number of kernels dominates small-batch decode. Parameters are created with torch.empty
(no random init): loading overwrites them, and initializing 100M+ weights costs seconds.

The forward on CPU goes layer by layer (with the fast paths of cpu_fast_paths.py); on CUDA it
takes fewer kernels: `_forward_few_rows` up to SMALL_M_MAX tokens, `_forward_fused_norms` above.
The draft heads (eagle3.py, mtp.py) run their decoder layer through the same few-row path
(`LlamaDecoderLayer.forward_few_rows`).

Under tensor parallelism (`tp`, parallel/) each rank holds its share of the heads, the MLP's
columns and the vocabulary (parallel/shard.py), sums the row-parallel projections' outputs
(o, down) and the embedding with one all-reduce each, and gathers the LM head's logits; the
few-row CUDA path, whose kernels add the projections into the residual stream, is off.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from outpace.attention.base import ForwardContext
from outpace.kernels import use_triton
from outpace.kernels.argmax import argmax_rows
from outpace.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_triton, rms_norm_triton
from outpace.kernels.options import current as kernel_options
from outpace.kernels.skinny_gemm import (SMALL_M_MAX, mid_rows_ok, norm_qkv_rope_store,
                                          norm_qkv_rope_store_triton, norm_small_linear,
                                          norm_small_linear_silu_mul, silu_mul, small_linear,
                                          small_linear_silu_mul_triton, small_linear_triton)
from outpace.model_config import ModelConfig
from outpace.models.cpu_fast_paths import add_weight_copies_, cpu_threads_for, linear
from outpace.models.llama_weights import layer_part_from_, load_weights, param_slices
from outpace.models.rotary import RotaryEmbedding
from outpace.models.weight_dtype import upcast_embedding
from outpace.parallel.group import SINGLE, TensorParallel
from outpace.parallel.shard import kv_head_start, vocab_range, vocab_rows


def _param(*shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))


# The few-row kernels (KernelOptions.few_row_kernels) run models this narrow: the fused
# projections beat cuBLAS + separate norms at SmolLM2's widths, but at Llama-8B's (4096) the
# norm-fused qkv is slower than cuBLAS + a norm, so wide models keep cuBLAS (measured on the
# H200, benchmarks/results/small_linear_h200.json; decisions-log.md, "Fewer kernels per decoder
# layer on CUDA"). The other switches of these paths (fused_qkv_rope_store, mid_row_kernels) are
# KernelOptions fields too (kernels/options.py).
FEW_ROW_MAX_HIDDEN = 2048


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: statistics in fp32, cast back, then scale by the weight."""
    if x.is_cuda and use_triton(x):
        return rms_norm_triton(x, weight, eps)  # one kernel instead of five
    if x.dtype == torch.float32:
        # HF's arithmetic in five small ops; on CPU this is faster than F.rms_norm (a
        # composite of more ops there) for decode-sized inputs, with identical values.
        r = torch.mean(x * x, -1, keepdim=True).add_(eps).rsqrt_()
        return (x * r).mul_(weight)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.weight = _param(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x):  # [..., size] -> [..., size]
        return rms_norm(x, self.weight, self.eps)


class LlamaAttention(nn.Module):
    """qkv_proj (fused) -> [q/k norm] -> rope -> backend (paged KV, slot `layer_slot`) -> o_proj.

    `qkv_input_size` lets a draft head feed a wider input (EAGLE-3: [embedding, hidden] = 2H).
    """

    def __init__(self, cfg: ModelConfig, layer_slot: int, qkv_input_size: Optional[int] = None,
                 dtype=torch.float32, device="cpu", tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer_slot = layer_slot
        self.tp = tp  # this rank's heads: cfg's / tp.size (KV heads at least 1)
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = max(cfg.num_key_value_heads // tp.size, 1)
        self.kv_head_start = kv_head_start(cfg, tp.rank, tp.size)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        in_size = qkv_input_size or cfg.hidden_size
        kw = dict(dtype=dtype, device=device)
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, in_size, **kw)
        qkv_bias = cfg.attention_bias or cfg.architecture == "qwen2"
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, **kw) if qkv_bias else None
        self.o_weight = _param(cfg.hidden_size, self.q_size, **kw)
        o_bias = cfg.attention_bias and cfg.architecture != "qwen2"  # Qwen2: bias on q/k/v only
        self.o_bias = _param(cfg.hidden_size, **kw) if o_bias else None
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, **kw) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, **kw) if cfg.qk_norm else None

    def forward(self, x, cos_sin, rope: RotaryEmbedding, ctx: ForwardContext):
        # x [T, qkv_input_size] -> [T, hidden]
        if self._mid_rows(x, cos_sin):  # CUDA, a prefill's rows: KernelOptions.mid_row_kernels
            t, meta, backend = x.shape[0], ctx.meta, ctx.backend
            q = norm_qkv_rope_store_triton(x, None, 0.0, self.qkv_weight, self.num_heads,
                                           self.num_kv_heads, self.head_dim, rope.cos, rope.sin,
                                           cos_sin[2], backend.kv_cache, self.layer_slot,
                                           meta.slot_mapping)
            o = backend.attend_stored(self.layer_slot, q, meta).reshape(t, self.q_size)
        else:
            qkv = linear(x, self, "qkv_weight", self.qkv_bias)  # [T, (Hq + 2 Hkv) * D]
            o = self.attend(qkv, cos_sin, rope, ctx)
        if (kernel_options().mid_row_kernels and self.o_bias is None
                and mid_rows_ok(o, self.o_weight)):
            out = small_linear_triton(o, self.o_weight)
        else:  # (row-parallel: the bias added once, by rank 0, before the sum)
            out = linear(o, self, "o_weight", self.o_bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce_(out)

    def _mid_rows(self, x, cos_sin) -> bool:
        """Whether forward's qkv projection takes the Triton kernel with rope and the KV store
        (KernelOptions.mid_row_kernels): CUDA's rope path (the backend rotates and stores), no q/k norm and
        no bias, and a shape mid_rows_ok takes."""
        o = kernel_options()
        return (o.mid_row_kernels and o.fused_qkv_rope_store and cos_sin[0] is None
                and self.q_norm is None and self.qkv_bias is None and self.head_dim % 2 == 0
                and mid_rows_ok(x, self.qkv_weight, self.qkv_weight.shape[0] // 2))

    def attend(self, qkv, cos_sin, rope: RotaryEmbedding, ctx: ForwardContext):
        # qkv [T, (Hq + 2 Hkv) * D] (projected) -> attention output [T, Hq * D], before o_proj
        t, hq, hkv = qkv.shape[0], self.num_heads, self.num_kv_heads
        heads = qkv.view(t, hq + 2 * hkv, self.head_dim)
        v = heads[:, hq + hkv:]  # [T, Hkv, D] (a view: backends must honour strides)
        q, k = heads[:, :hq], heads[:, hq:hq + hkv]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos_sin[0] is None:  # CUDA: the backend rotates (and stores K/V) in one kernel
            out = ctx.backend.forward_rope(self.layer_slot, q, k, v, ctx.meta, rope.cos,
                                           rope.sin, cos_sin[2])
        else:
            if self.q_norm is None:
                qk = rope.apply(heads[:, :hq + hkv], cos_sin)  # q and k rotated in one pass
                q, k = qk[:, :hq], qk[:, hq:]
            else:
                q, k = rope.apply_qk(q, k, cos_sin)
            out = ctx.backend.forward(self.layer_slot, q, k, v, ctx.meta)  # [T, Hq, D]
        return out.reshape(t, self.q_size)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=torch.float32, device="cpu",
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.inter = cfg.intermediate_size // tp.size  # this rank's columns
        self.gate_up_weight = _param(2 * self.inter, cfg.hidden_size, dtype=dtype, device=device)
        self.down_weight = _param(cfg.hidden_size, self.inter, dtype=dtype, device=device)

    def forward(self, x):  # [T, H] -> [T, H]
        if kernel_options().mid_row_kernels and mid_rows_ok(x, self.gate_up_weight, self.inter):
            # CUDA, a prefill's rows: gate_up with silu * mul in one Triton kernel
            return self.tp.all_reduce_(linear(small_linear_silu_mul_triton(
                x, self.gate_up_weight), self, "down_weight"))
        gu = linear(x, self, "gate_up_weight")  # [T, 2I]
        if use_triton(gu):
            a = silu_mul(gu)  # one kernel, the same rounding
        else:
            a = F.silu(gu[:, :self.inter])
            a.mul_(gu[:, self.inter:])
        return self.tp.all_reduce_(linear(a, self, "down_weight"))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h)).

    Draft heads reuse it with their own `layer_slot` (their KV plane) and `qkv_input_size`;
    on CUDA with few rows they call forward_few_rows, as the target's forward does.
    """

    def __init__(self, cfg: ModelConfig, layer_slot: int, qkv_input_size: Optional[int] = None,
                 dtype=torch.float32, device="cpu", tp: TensorParallel = SINGLE):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.layer_slot = layer_slot
        self.hidden_size = cfg.hidden_size
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = LlamaAttention(cfg, layer_slot, qkv_input_size, **kw, tp=tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = LlamaMLP(cfg, **kw, tp=tp)

    def forward(self, hidden, cos_sin, rope: RotaryEmbedding, ctx: ForwardContext,
                attn_input=None):
        # hidden [T, H] (residual stream) -> [T, H], a new tensor (`hidden` is not modified).
        # attn_input [T, qkv_input_size]: the already-normalized qkv input, for heads whose
        # attention reads more than the residual (EAGLE-3); default input_layernorm(hidden).
        if attn_input is None:
            attn_input = self.input_layernorm.forward(hidden)
        # .forward: nn.Module.__call__ (hook handling) costs a few us a call, which adds up
        # over the ~200 calls of a CPU decode step.
        h = self.self_attn.forward(attn_input, cos_sin, rope, ctx)
        norm = self.post_attention_layernorm
        if h.is_cuda and use_triton(h):
            normed, h = fused_add_rms_norm_triton(h, hidden, norm.weight, norm.eps)
        else:
            h += hidden  # h is fresh from o_proj: add in place, no extra buffer
            normed = norm.forward(h)
        out = self.mlp.forward(normed)
        out += h
        return out

    def load_part_of_(self, whole: "LlamaDecoderLayer") -> None:
        """This rank's share (self's tp) of an unsharded layer's weights (llama_weights.py)."""
        layer_part_from_(self, whole)

    def takes_few_rows(self, x: torch.Tensor) -> bool:
        """Whether a draft head should run this layer on `x` through forward_few_rows: CUDA
        with triton, at most SMALL_M_MAX rows, the few-row kernels on, and few_rows_ok()."""
        return (use_triton(x) and x.shape[0] <= SMALL_M_MAX
                and kernel_options().few_row_kernels and self.few_rows_ok())

    def few_rows_ok(self) -> bool:
        """Whether forward_few_rows can run this layer: narrow enough (FEW_ROW_MAX_HIDDEN) and
        no biases (the few-row kernels have none), unsharded (they add o and down into the
        residual stream before a sum over ranks could). The caller checks the rest: CUDA with
        triton and at most SMALL_M_MAX rows."""
        a = self.self_attn
        return (self.hidden_size <= FEW_ROW_MAX_HIDDEN and a.tp.size == 1
                and a.qkv_bias is None and a.o_bias is None)

    def forward_few_rows(self, residual, cos_sin, rope: RotaryEmbedding, ctx: ForwardContext,
                         attn_input=None, out=None):
        """forward() on CUDA for at most SMALL_M_MAX tokens (decode at small batch, verify, the
        draft heads' steps): residual [T, H] -> the new residual stream [T, H], a fresh tensor
        (or `out`, a [T, H] view with a unit last stride: the model's captured layers).

        Five kernels instead of fourteen: four projections and attention. With
        KernelOptions.fused_qkv_rope_store the qkv projection also applies rope and writes K/V
        into the pool (else a sixth kernel does), and split-KV attention merges its splits
        itself (attention/triton_paged.py). Each norm runs inside the projection that reads it
        (kernels/skinny_gemm/), and o_proj / down_proj add their output to the residual stream in fp32 before rounding once (forward() rounds the
        projection's output first, so bf16 values can differ by an ulp).

        attn_input [T, qkv_input_size]: as in forward(), an already-normalized qkv input
        (EAGLE-3); the qkv projection then reads it as is, with no norm fused in.
        Requires few_rows_ok(); on CPU the dispatchers run their PyTorch references."""
        attn, mlp, post = self.self_attn, self.mlp, self.post_attention_layernorm
        ln, t = self.input_layernorm, residual.shape[0]
        if kernel_options().fused_qkv_rope_store and attn.q_norm is None and cos_sin[0] is None:
            # norm, qkv, rope and the KV store in one kernel (an EAGLE-3 attn_input comes
            # normalized: no norm then); attention reads the pool
            meta, backend = ctx.meta, ctx.backend
            x, nw = (residual, ln.weight) if attn_input is None else (attn_input, None)
            q = norm_qkv_rope_store(x, nw, ln.eps, attn.qkv_weight,
                                    attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                    rope.cos, rope.sin, cos_sin[2], backend.kv_cache,
                                    attn.layer_slot, meta.slot_mapping)
            o = backend.attend_stored(attn.layer_slot, q, meta).reshape(t, attn.q_size)
        else:  # (Qwen3's q/k norm sits between the projection and rope)
            if attn_input is None:
                qkv = norm_small_linear(residual, ln.weight, ln.eps, attn.qkv_weight)
            else:
                qkv = small_linear(attn_input, attn.qkv_weight)
            o = attn.attend(qkv, cos_sin, rope, ctx)
        residual = small_linear(o, attn.o_weight, residual=residual)
        a = norm_small_linear_silu_mul(residual, post.weight, post.eps, mlp.gate_up_weight)
        return small_linear(a, mlp.down_weight, residual=residual, out=out)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=torch.float32, device="cpu",
                 max_positions: Optional[int] = None, tp: TensorParallel = SINGLE):
        # max_positions: the positions the rope tables cover (None: the model's; rotary.py).
        # tp: this rank's share (its heads, MLP columns and vocabulary rows); `config` stays
        # the whole model's.
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.config = cfg
        self.tp = tp
        self.vocab_start, self.vocab_held = vocab_range(cfg.vocab_size, tp.rank, tp.size)
        rows = vocab_rows(cfg.vocab_size, tp.size)
        self.embed_weight = _param(rows, cfg.hidden_size, **kw)
        self.rotary = RotaryEmbedding(cfg, **kw, max_positions=max_positions)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, **kw, tp=tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        if cfg.tie_word_embeddings:
            self.lm_head_weight = self.embed_weight  # the same Parameter, loaded once
        else:
            self.lm_head_weight = _param(rows, cfg.hidden_size, **kw)
        with torch.no_grad():  # a last shard's rows past the vocabulary (loading skips them)
            for w in {id(self.embed_weight): self.embed_weight,
                      id(self.lm_head_weight): self.lm_head_weight}.values():
                w[self.vocab_held:].zero_()

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (residual stream, KV cache): the norm weights'. The matrices may
        be stored narrower (weight_dtype.store_weights_in_), and every use upcasts them to
        this; norm weights never are, so this follows the model through `.to(dtype)`."""
        return self.norm.weight.dtype

    def embed_tokens(self, input_ids):  # [T] long -> [T, H] of self.dtype
        if self.tp.size == 1:
            return upcast_embedding(input_ids, self.embed_weight, self.dtype)
        # vocab-parallel: each rank's rows for the ids it holds, zeros for the rest, summed
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_held)
        e = upcast_embedding(local.masked_fill(outside, 0), self.embed_weight, self.dtype)
        return self.tp.all_reduce_(e.masked_fill_(outside.unsqueeze(-1), 0))

    def forward(self, input_ids, positions, ctx: ForwardContext, capture_layers: tuple = (),
                inputs_embeds=None):
        # input_ids [T] long, positions [T] long -> (hidden [T, H] after the final norm,
        # aux [len(capture_layers)] of [T, H]: the residual stream output by layer i, in the
        # order asked; HF's hidden_states[i + 1], except that for the last layer HF's entry is
        # after the final norm and ours is before it)
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if use_triton(h):  # CUDA with triton
            return self._forward_fused_norms(h, positions, ctx, capture_layers)
        with cpu_threads_for(h, ctx.meta.max_query_len):
            cos_sin = self.rotary(positions)
            captured = {}
            for i, layer in enumerate(self.layers):
                # a fresh tensor each layer: safe to keep (.forward: see LlamaDecoderLayer)
                h = layer.forward(h, cos_sin, self.rotary, ctx)
                if i in capture_layers:
                    captured[i] = h
            return self.norm(h), [captured[i] for i in capture_layers]

    def _forward_fused_norms(self, h, positions, ctx: ForwardContext, capture_layers: tuple):
        """forward() on CUDA: the same values with fewer kernels. Each layer's MLP output is
        added to the residual stream by the kernel that also norms it for the next layer (or
        the final norm), as the attention output is by the post-attention norm; the add and the
        norm round exactly as LlamaDecoderLayer's `out += h` and the next `rms_norm` do."""
        if (h.shape[0] <= SMALL_M_MAX and kernel_options().few_row_kernels
                and self._few_rows_ok()):
            return self._forward_few_rows(h, positions, ctx, capture_layers)
        cos_sin = self.rotary(positions)
        layers = self.layers
        residual = h
        first = layers[0].input_layernorm
        normed = rms_norm(h, first.weight, first.eps)
        captured = {}
        for i, layer in enumerate(layers):
            attn = layer.self_attn.forward(normed, cos_sin, self.rotary, ctx)
            post = layer.post_attention_layernorm
            normed, residual = fused_add_rms_norm(attn, residual, post.weight, post.eps)
            mlp = layer.mlp.forward(normed)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            # residual: the stream after layer i (a fresh tensor, safe to keep)
            normed, residual = fused_add_rms_norm(mlp, residual, nxt.weight, nxt.eps)
            if i in capture_layers:
                captured[i] = residual
        return normed, [captured[i] for i in capture_layers]

    def _few_rows_ok(self) -> bool:
        """Whether _forward_few_rows can run this model: every layer's few_rows_ok()."""
        ok = getattr(self, "_few_rows", None)
        if ok is None:  # cached: the weights' shapes and biases do not change
            ok = all(layer.few_rows_ok() for layer in self.layers)
            self._few_rows = ok
        return ok

    def _forward_few_rows(self, h, positions, ctx: ForwardContext, capture_layers: tuple):
        """forward() on CUDA for at most SMALL_M_MAX tokens (decode at small batch, verify):
        LlamaDecoderLayer.forward_few_rows a layer (five kernels instead of fourteen), then the
        final norm."""
        cos_sin = self.rotary(positions)
        residual = h
        # The captured layers write their residual stream side by side into one [T, n * H]
        # tensor, in the order asked: a head that concatenates them (EAGLE-3's fc) reads it
        # as is, without a copy (eagle3.side_by_side). The next layer reads the strided view;
        # the few-row kernels take any row stride.
        hs = h.shape[1]
        side = h.new_empty(h.shape[0], len(capture_layers) * hs)
        views = [side[:, j * hs:(j + 1) * hs] for j in range(len(capture_layers))]
        for i, layer in enumerate(self.layers):
            out = views[capture_layers.index(i)] if i in capture_layers else None
            residual = layer.forward_few_rows(residual, cos_sin, self.rotary, ctx, out=out)
        for j, i in enumerate(capture_layers):
            first = capture_layers.index(i)
            if first != j:  # a layer asked for twice (a shallow model's default aux ids)
                views[j].copy_(views[first])
        return self.norm(residual), views

    def add_cpu_weight_copies_(self) -> None:
        """CPU only: faster-to-read copies of the projection weights (cpu_fast_paths.py), in
        the activation dtype."""
        add_weight_copies_(self, self.dtype)

    def _logits(self, hidden):  # [N, H] -> [N, V] in the model's dtype
        rows = linear(hidden, self, "lm_head_weight")
        if self.tp.size == 1:
            return rows
        # vocab-parallel: every rank's rows side by side, the last shard's padding cut
        return self.tp.all_gather_last(rows)[:, :self.config.vocab_size].contiguous()

    def compute_logits(self, hidden):  # [N, H] -> [N, V] float32
        with cpu_threads_for(hidden):
            return self._logits(hidden).float()

    def greedy_tokens(self, hidden, also: tuple = ()):  # [N, H] -> [N] int64
        # argmax of compute_logits, also written into `also` ([N] int64 views; argmax_rows).
        # The argmax of the logits in the model's dtype is the argmax of their fp32 copy (the
        # conversion is exact), so the conversion kernel is skipped.
        with cpu_threads_for(hidden):
            return argmax_rows(self._logits(hidden), also=also)

    # ---- loading -------------------------------------------------------------------------

    def param_slices(self) -> dict:
        """HF parameter name -> where it goes in this model (llama_weights.param_slices)."""
        return param_slices(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy HF-named tensors into the (fused) parameters; the names it did not use
        (llama_weights.load_weights: ModelLoadError on a shape mismatch or a missing tensor)."""
        return load_weights(self, weights)
