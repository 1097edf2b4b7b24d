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
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from outpace.attention.base import ForwardContext
from outpace.config import ModelConfig
from outpace.errors import ModelLoadError, UnsupportedModelError
from outpace.kernels import use_triton
from outpace.kernels.norm import fused_add_rms_norm_triton, rms_norm_triton
from outpace.kernels.rope import apply_rope_triton


def _param(*shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))


# Decode-shaped inputs (at most this many rows) use the column-major copy of a weight on CPU.
_FEW_ROWS = 2


def linear(x: torch.Tensor, module: nn.Module, name: str, bias=None) -> torch.Tensor:
    """F.linear with `module.<name>`, or its column-major copy for few rows on CPU (see
    LlamaForCausalLM.add_column_major_copies_)."""
    w = getattr(module, name)
    if x.shape[0] <= _FEW_ROWS:
        w = module.__dict__.get(name + "_cm", w)
    return F.linear(x, w, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: statistics in fp32, cast back, then scale by the weight."""
    if x.is_cuda and use_triton(x):
        return rms_norm_triton(x, weight, eps)  # one kernel instead of five
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused kernel
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


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with the configured scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if not sc:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "freq_factors":  # GGUF rope_freqs tensor: per-frequency divisors (llama.cpp)
        factors = torch.tensor(sc["factors"], dtype=torch.float32)
        if factors.numel() != inv.numel():
            raise UnsupportedModelError(
                f"rope_freqs has {factors.numel()} entries, expected {inv.numel()} (head_dim/2)")
        return inv / factors
    if kind == "llama3":
        # Long wavelengths are stretched by `factor`, short ones kept, the band between them
        # interpolated linearly in 1/wavelength (Llama 3.1 paper, section 3.3).
        factor = float(sc["factor"])
        lo, hi = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_len = float(sc.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(mid, blended, scaled)
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported")


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate_half) rope with cos/sin tables precomputed once for every position.

    rope(x) = x * cos + roll(x, D/2) * sin_signed, where sin_signed = [-sin, sin] folds
    rotate_half's negation into the table, so applying it is three elementwise ops.
    """

    def __init__(self, cfg: ModelConfig, dtype=torch.float32, device="cpu"):
        super().__init__()
        inv = rope_inv_freq(cfg)
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [P, D/2], fp32 as HF computes it
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        half = cfg.head_dim // 2
        sin[:, :half].neg_()
        self.half = half
        self.register_buffer("cos", emb.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", sin.to(dtype=dtype, device=device), persistent=False)

    def forward(self, positions):
        # [T] long -> (cos [T, 1, D], sin [T, 1, D], positions); on CUDA the Triton kernel
        # reads the tables itself: (None, None, positions)
        if positions.is_cuda and use_triton(positions):
            return None, None, positions
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1), positions

    def apply_qk(self, q, k, cos_sin):
        """Rotate q [T, Hq, D] and k [T, Hkv, D]; may work in place (they are fresh)."""
        if cos_sin[0] is None:
            # Table columns D/2.. hold cos(f) and the unsigned sin(f), as the kernel expects.
            return apply_rope_triton(q, k, self.cos, self.sin, cos_sin[2])
        return self.apply(q, cos_sin), self.apply(k, cos_sin)

    def apply(self, x, cos_sin):  # x [T, H, D] -> [T, H, D] (new tensor)
        cos, sin = cos_sin[0], cos_sin[1]
        return torch.addcmul(x * cos, torch.roll(x, self.half, dims=-1), sin)


class LlamaAttention(nn.Module):
    """qkv_proj (fused) -> [q/k norm] -> rope -> backend (paged KV, slot `layer_slot`) -> o_proj.

    `qkv_input_size` lets a draft head feed a wider input (EAGLE-3: [embedding, hidden] = 2H).
    """

    def __init__(self, cfg: ModelConfig, layer_slot: int, qkv_input_size: Optional[int] = None,
                 dtype=torch.float32, device="cpu"):
        super().__init__()
        self.layer_slot = layer_slot
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
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
        qkv = linear(x, self, "qkv_weight", self.qkv_bias)  # [T, (Hq + 2 Hkv) * D]
        t, hq, hkv = qkv.shape[0], self.num_heads, self.num_kv_heads
        heads = qkv.view(t, hq + 2 * hkv, self.head_dim)
        v = heads[:, hq + hkv:]  # [T, Hkv, D] (a view: backends must honour strides)
        if self.q_norm is None and cos_sin[0] is not None:
            qk = rope.apply(heads[:, :hq + hkv], cos_sin)  # q and k rotated in one pass
            q, k = qk[:, :hq], qk[:, hq:]
        elif self.q_norm is None:
            q, k = rope.apply_qk(heads[:, :hq], heads[:, hq:hq + hkv], cos_sin)
        else:
            q, k = rope.apply_qk(self.q_norm(heads[:, :hq]), self.k_norm(heads[:, hq:hq + hkv]),
                                 cos_sin)
        out = ctx.backend.forward(self.layer_slot, q, k, v, ctx.meta)  # [T, Hq, D]
        return linear(out.reshape(t, self.q_size), self, "o_weight", self.o_bias)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_weight = _param(2 * self.inter, cfg.hidden_size, dtype=dtype, device=device)
        self.down_weight = _param(cfg.hidden_size, self.inter, dtype=dtype, device=device)

    def forward(self, x):  # [T, H] -> [T, H]
        gu = linear(x, self, "gate_up_weight")  # [T, 2I]
        a = F.silu(gu[:, :self.inter])
        a.mul_(gu[:, self.inter:])
        return linear(a, self, "down_weight")


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h)).

    Draft heads reuse it with their own `layer_slot` (their KV plane) and `qkv_input_size`.
    """

    def __init__(self, cfg: ModelConfig, layer_slot: int, qkv_input_size: Optional[int] = None,
                 dtype=torch.float32, device="cpu"):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.layer_slot = layer_slot
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = LlamaAttention(cfg, layer_slot, qkv_input_size, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = LlamaMLP(cfg, **kw)

    def forward(self, hidden, cos_sin, rope: RotaryEmbedding, ctx: ForwardContext,
                attn_input=None):
        # hidden [T, H] (residual stream) -> [T, H], a new tensor (`hidden` is not modified).
        # attn_input [T, qkv_input_size]: the already-normalized qkv input, for heads whose
        # attention reads more than the residual (EAGLE-3); default input_layernorm(hidden).
        if attn_input is None:
            attn_input = self.input_layernorm(hidden)
        h = self.self_attn(attn_input, cos_sin, rope, ctx)
        norm = self.post_attention_layernorm
        if h.is_cuda and use_triton(h):
            normed, h = fused_add_rms_norm_triton(h, hidden, norm.weight, norm.eps)
        else:
            h += hidden  # h is fresh from o_proj: add in place, no extra buffer
            normed = norm(h)
        out = self.mlp(normed)
        out += h
        return out


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=torch.float32, device="cpu"):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.config = cfg
        self.dtype = dtype
        self.embed_weight = _param(cfg.vocab_size, cfg.hidden_size, **kw)
        self.rotary = RotaryEmbedding(cfg, **kw)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, **kw) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        if cfg.tie_word_embeddings:
            self.lm_head_weight = self.embed_weight  # the same Parameter, loaded once
        else:
            self.lm_head_weight = _param(cfg.vocab_size, cfg.hidden_size, **kw)

    def embed_tokens(self, input_ids):  # [T] long -> [T, H]
        return F.embedding(input_ids, self.embed_weight)

    def forward(self, input_ids, positions, ctx: ForwardContext, capture_layers: tuple = (),
                inputs_embeds=None):
        # input_ids [T] long, positions [T] long -> (hidden [T, H] after the final norm,
        # aux [len(capture_layers)] of [T, H]: the residual stream output by layer i, in the
        # order asked; HF's hidden_states[i + 1], except that for the last layer HF's entry is
        # after the final norm and ours is before it)
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos_sin = self.rotary(positions)
        captured = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, cos_sin, self.rotary, ctx)  # a fresh tensor each layer: safe to keep
            if i in capture_layers:
                captured[i] = h
        return self.norm(h), [captured[i] for i in capture_layers]

    def add_column_major_copies_(self) -> None:
        """CPU only: keep a column-major copy (a transposed view of a contiguous [in, out]
        buffer) of every projection weight, used when a forward has at most _FEW_ROWS rows.
        MKL streams a column-major weight 1.3x faster for one or two rows (1.8x for the LM
        head) but slower for four or more (measured on the 2-core CI machine), so decode uses
        the copy and prefill the original. Costs a second copy of the weights in RAM; values
        are identical."""
        for m in self.modules():
            for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight",
                         "lm_head_weight"):
                p = getattr(m, name, None)
                if isinstance(p, torch.Tensor) and p.dim() == 2:
                    m.__dict__[name + "_cm"] = p.detach().t().contiguous().t()

    def compute_logits(self, hidden):  # [N, H] -> [N, V] float32
        return linear(hidden, self, "lm_head_weight").float()

    # ---- loading -------------------------------------------------------------------------

    def param_slices(self) -> dict:
        """HF parameter name -> (destination Parameter, first row, rows) for load_weights."""
        out = {"model.embed_tokens.weight": (self.embed_weight, 0),
               "model.norm.weight": (self.norm.weight, 0)}
        if not self.config.tie_word_embeddings:
            out["lm_head.weight"] = (self.lm_head_weight, 0)
        for i, layer in enumerate(self.layers):
            p, a, mlp = f"model.layers.{i}.", layer.self_attn, layer.mlp
            out[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, 0)
            out[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, 0)
            offs = {"q": (0, a.q_size), "k": (a.q_size, a.kv_size),
                    "v": (a.q_size + a.kv_size, a.kv_size)}
            for n, (off, rows) in offs.items():
                out[f"{p}self_attn.{n}_proj.weight"] = (a.qkv_weight, off, rows)
                if a.qkv_bias is not None:
                    out[f"{p}self_attn.{n}_proj.bias"] = (a.qkv_bias, off, rows)
            out[p + "self_attn.o_proj.weight"] = (a.o_weight, 0)
            if a.o_bias is not None:
                out[p + "self_attn.o_proj.bias"] = (a.o_bias, 0)
            if a.q_norm is not None:
                out[p + "self_attn.q_norm.weight"] = (a.q_norm.weight, 0)
                out[p + "self_attn.k_norm.weight"] = (a.k_norm.weight, 0)
            out[p + "mlp.gate_proj.weight"] = (mlp.gate_up_weight, 0, mlp.inter)
            out[p + "mlp.up_proj.weight"] = (mlp.gate_up_weight, mlp.inter, mlp.inter)
            out[p + "mlp.down_proj.weight"] = (mlp.down_weight, 0)
        return {k: v if len(v) == 3 else (v[0], 0, v[0].shape[0]) for k, v in out.items()}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy HF-named tensors into the (fused) parameters; returns the names it did not use.

        Raises ModelLoadError on a shape mismatch or when a parameter got no tensor.
        """
        slots = self.param_slices()
        missing, unused = set(slots), []
        for name, tensor in weights:
            if name not in slots:
                if not name.endswith("rotary_emb.inv_freq"):  # HF buffer, recomputed here
                    unused.append(name)
                continue
            dest, off, rows = slots[name]
            target = dest.narrow(0, off, rows)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"tensor {name} has shape {tuple(tensor.shape)}, but the model config "
                    f"expects {tuple(target.shape)}; the weights do not match config.json")
            target.copy_(tensor)
            missing.discard(name)
        if missing:
            names = sorted(missing)
            raise ModelLoadError(
                f"the checkpoint lacks {len(names)} tensor(s) the model needs, e.g. "
                f"{', '.join(names[:4])}; the files are incomplete or for another architecture")
        return unused
