"""GGUF tensor types -> float32: Q8_0, Q4_0, Q4_1, F16 and BF16 with torch ops (bit-identical to
gguf.quants, faster on one thread, and on the GPU itself when loading to CUDA), the K-quants
through the `gguf` package's numpy code; `QuantizedTensor`, a tensor dequantized straight into
its weight when the loader copies it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from outpace.errors import UnsupportedModelError

if TYPE_CHECKING:
    import torch

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


def _f16_pairs(b: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """n float16 values per block from byte column `start` -> float32 [blocks, n]."""
    import torch
    return b[:, start:start + 2 * n].contiguous().view(torch.float16).float()


def dequantize(raw: np.ndarray, type_name: str, shape: tuple, device=None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """raw uint8 [rows, bytes_per_row] -> float32 tensor of `shape`, or written into `out` (a
    contiguous float32 tensor of `shape` on the device: a weight's place in the model, so the
    values are not copied a second time); the same values either way.

    On a CUDA `device` the raw bytes are moved first and dequantized there (fast, and the host
    never holds the float32 copy); K-quants always go through gguf's numpy code on the host.
    """
    import torch
    if type_name not in SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"GGUF tensor type {type_name} is not supported; outpace reads "
            f"{', '.join(SUPPORTED_TYPES)} (re-quantize the model to one of them)")
    if out is not None:
        if not (out.dtype == torch.float32 and out.is_contiguous()
                and tuple(out.shape) == tuple(shape)):
            raise ValueError(f"out must be a contiguous float32 tensor of shape {tuple(shape)}")
        device = out.device
    t = torch.from_numpy(raw)
    if device is not None and torch.device(device).type != "cpu":
        t = t.to(device)
    floats = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(type_name)
    if floats is not None:
        v = t.view(floats).reshape(shape)
        return v.float() if out is None else out.copy_(v)
    if type_name == "Q8_0":  # block: f16 scale, 32 x int8
        b = t.reshape(-1, 34)
        q, scale = b[:, 2:].view(torch.int8), _f16_pairs(b, 0, 1)
        if out is None:
            return (q * scale).reshape(shape)
        torch.mul(q, scale, out=out.view(-1, 32))
        return out
    if type_name in ("Q4_0", "Q4_1"):  # block: f16 scale [, f16 min], 16 bytes of nibble pairs
        b = t.reshape(-1, 18 if type_name == "Q4_0" else 20)
        qs = b[:, -16:]
        # low nibbles are elements 0..15 of the block, high nibbles 16..31
        o = (torch.empty(b.shape[0], 2, 16, device=b.device) if out is None
             else out.view(-1, 2, 16))
        o[:, 0].copy_(qs & 0x0F)
        o[:, 1].copy_(qs >> 4)
        o = o.view(-1, 32)
        if type_name == "Q4_0":
            o.sub_(8).mul_(_f16_pairs(b, 0, 1))
        else:
            dm = _f16_pairs(b, 0, 2)
            o.mul_(dm[:, :1]).add_(dm[:, 1:])
        return o.reshape(shape) if out is None else out
    import gguf  # K-quants: gguf's numpy implementation
    qt = gguf.GGMLQuantizationType[type_name]
    v = torch.from_numpy(gguf.quants.dequantize(raw, qt)).reshape(shape)
    return v if out is None else out.copy_(v)


class QuantizedTensor:
    """A GGUF tensor not yet dequantized: its `shape`, and `copy_into(target)`, which
    dequantizes straight into the target where it can (a contiguous float32 weight on the
    device: one pass over the values, not two) and else copies (rounding to the target's
    dtype); `load_weights` takes it in place of a tensor."""

    def __init__(self, raw: np.ndarray, type_name: str, shape: tuple, device=None):
        self.raw, self.type_name, self.shape, self.device = raw, type_name, tuple(shape), device

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.raw, self.type_name, self.shape, self.device)

    def part(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows start .. start + length - 1 (dim 0) dequantized alone: a tensor-parallel
        rank's part (a GGUF row is its own run of blocks); along another dim the whole tensor,
        then its part."""
        rows = self.raw if self.raw.ndim == 2 and self.raw.shape[0] == self.shape[0] else None
        if dim != 0 or rows is None:
            return self.dequantize().narrow(dim, start, length)
        return dequantize(rows[start:start + length], self.type_name,
                          (length, *self.shape[1:]), self.device)

    def copy_into(self, target: torch.Tensor) -> None:
        import torch
        on = torch.device("cpu" if self.device is None else self.device).type
        if (target.dtype == torch.float32 and target.is_contiguous() and target.device.type == on
                and tuple(target.shape) == self.shape):
            dequantize(self.raw, self.type_name, self.shape, out=target)
        else:
            target.copy_(self.dequantize())
