"""Rotary position embedding (neox style) for the Llama family: the inverse frequencies with the
configured scaling (linear, llama3, GGUF per-frequency factors) and the cos/sin tables, computed
once for every position the engine can reach. On CPU the model applies them itself; on CUDA the
Triton kernels read the tables (kernels/rope.py, and the qkv projection's epilogue in
kernels/skinny_gemm/).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from outpace.errors import UnsupportedModelError
from outpace.kernels import use_triton
from outpace.model_config import ModelConfig


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


# Rows past the model's last position. A graph's draft loop runs its fixed number of steps for
# every request (runner/fused_step.py) and the host trims the drafts; near the context's end
# those discarded steps reach up to k - 3 positions past it (k <= config.MAX_DRAFT_TOKENS, 16),
# and the rope kernels index the tables without a bound check.
POSITION_MARGIN = 16


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate_half) rope with cos/sin tables precomputed once for every position.

    rope(x) = x * cos + roll(x, D/2) * sin_signed, where sin_signed = [-sin, sin] folds
    rotate_half's negation into the table, so applying it is three elementwise ops.

    max_positions: the positions the tables cover (plus POSITION_MARGIN), at most the model's
    max_position_embeddings; None: all of those. The engine passes its context length: a model
    may claim millions of positions, and the tables grow with them (2 x head_dim values each).
    """

    def __init__(self, cfg: ModelConfig, dtype=torch.float32, device="cpu",
                 max_positions: Optional[int] = None):
        super().__init__()
        positions = cfg.max_position_embeddings
        if max_positions is not None:
            if isinstance(max_positions, bool) or not isinstance(max_positions, int) \
                    or max_positions < 1:
                raise ValueError(f"max_positions must be an integer >= 1, got {max_positions!r}")
            positions = min(positions, max_positions)
        self.max_positions = positions
        half = cfg.head_dim // 2
        self.half = half
        shape = (positions + POSITION_MARGIN, cfg.head_dim)
        if torch.device(device).type == "meta":  # shapes only (nothing is computed)
            self.register_buffer("cos", torch.empty(shape, dtype=dtype, device=device),
                                 persistent=False)
            self.register_buffer("sin", torch.empty(shape, dtype=dtype, device=device),
                                 persistent=False)
            return
        inv = rope_inv_freq(cfg)
        t = torch.arange(shape[0], dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [P, D/2], fp32 as HF computes it
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, :half].neg_()
        self.register_buffer("cos", emb.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", sin.to(dtype=dtype, device=device), persistent=False)

    def forward(self, positions):
        # [T] long -> (cos [T, 1, D], sin [T, 1, D], positions); on CUDA the Triton kernel
        # reads the tables itself: (None, None, positions); their columns D/2.. hold cos(f)
        # and the unsigned sin(f), as the kernel expects
        if use_triton(positions):  # CUDA with triton
            return None, None, positions
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1), positions

    def apply_qk(self, q, k, cos_sin):  # CPU tables: q [T, Hq, D], k [T, Hkv, D] rotated
        return self.apply(q, cos_sin), self.apply(k, cos_sin)

    def apply(self, x, cos_sin):  # x [T, H, D] -> [T, H, D] (new tensor)
        cos, sin = cos_sin[0], cos_sin[1]
        return torch.addcmul(x * cos, torch.roll(x, self.half, dims=-1), sin)
