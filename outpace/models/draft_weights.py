"""The dtype a draft head's matrices are read in: `SpecConfig.draft_weight_dtype` resolved
against the engine's dtypes, its device and the CPU's instructions."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from outpace.models.cpu_fast_paths import cpu_has_bf16_dot, cpu_packs_bf16
from outpace.speculative_config import check_draft_weight_dtype


class DraftWeights(NamedTuple):
    stored: torch.dtype  # the head's parameters (load_draft_head's weight_dtype)
    cpu_copies: Optional[torch.dtype]  # add_weight_copies_'s `narrow`: None for fp32 copies


def draft_weights(choice: str, runner_cfg, cpuinfo: Optional[str] = None) -> DraftWeights:
    """How a draft head for an engine of `runner_cfg` keeps its matrices.

    auto: on a CPU with native bf16 products (cpu_has_bf16_dot) under float32 activations,
    bf16 copies that `linear` multiplies (a CPU draft pass streams its weights from memory:
    half the bytes); elsewhere the engine's weight_dtype, as the target's. bfloat16: read as
    bf16 on any device (on a CPU without oneDNN's bf16 linear, stored as bf16 and upcast).
    float32: as stored in fp32, which needs float32 activations (weights are never wider than
    the activations). A draft's dtype changes which tokens are proposed where two logits are
    within its rounding, never the output: the target verifies every draft.
    `cpuinfo`: /proc/cpuinfo's text (tests)."""
    check_draft_weight_dtype(choice, runner_cfg.dtype_name)
    act, stored = runner_cfg.torch_dtype, runner_cfg.torch_weight_dtype
    cpu = torch.device(runner_cfg.device).type == "cpu"
    if choice == "auto":
        if cpu and act == torch.float32 and cpu_has_bf16_dot(cpuinfo):
            return DraftWeights(stored, torch.bfloat16)
        return DraftWeights(stored, None)
    want = getattr(torch, choice)
    if cpu and want == torch.bfloat16 and act == torch.float32 and cpu_packs_bf16():
        return DraftWeights(stored, torch.bfloat16)
    return DraftWeights(want, None)
