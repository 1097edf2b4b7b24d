"""MTP proposer (DeepSeek-V3 style modules over the target's hidden states).

Two modes:
  eagle   (default with one module, or mtp_mode="eagle"): module 0 applied k times, chained
          exactly like an EAGLE head (see head_proposer.py).
  depths  (mtp_mode="depths", D modules): depth d uses module d, over the frontier-anchored
          window (see mtp_window.py; docs/design.md, "MTP: eagle mode and the
          frontier-anchored window").
"""

from __future__ import annotations

from torch import nn

from outpace.errors import ConfigError
from outpace.kernels.argmax import argmax_rows
from outpace.models.cpu_fast_paths import add_weight_copies_, cpu_threads_for, linear
from outpace.models.draft_weights import draft_weights
from outpace.parallel.group import SINGLE
from outpace.speculative.head_proposer import HeadProposer


def load_mtp_head(spec, model_cfg, runner_cfg, weights, max_positions=None, tp=None):
    """The MTP head, its matrices kept as `weights` (models/draft_weights.DraftWeights) say."""
    from outpace.models.draft_loader import load_draft_head
    return load_draft_head("mtp", spec.model, model_cfg,
                           first_layer_slot=model_cfg.num_hidden_layers,
                           dtype=runner_cfg.torch_dtype, device=runner_cfg.device,
                           weight_dtype=weights.stored, cpu_copies=weights.cpu_copies,
                           max_positions=max_positions, tp=tp)


class MTPEagleProposer(HeadProposer):
    """One MTP module applied k times."""

    def __init__(self, spec, policy, target, head, lm_head_copies=None):
        super().__init__(policy, target, spec)
        self.head = head
        self.num_kv_layers = head.num_kv_layers
        # The drafts' LM head is the target's. Where the head's matrices are read through bf16
        # copies (lm_head_copies: DraftWeights.cpu_copies), so is it, through a copy of its
        # own: on a CPU it is most of a draft step's bytes. The target's logits keep its
        # weights. Not under tensor parallelism, where a rank holds a share of the vocabulary.
        self._draft_lm_head = None
        if lm_head_copies is not None and getattr(target, "tp", SINGLE).size == 1:
            holder = nn.Module()
            holder.lm_head_weight = target.lm_head_weight
            add_weight_copies_(holder, target.dtype, narrow=lm_head_copies)
            self._draft_lm_head = holder

    def first_hidden(self, batch):
        return batch.hidden  # [T, H] target output

    def step(self, hidden, input_ids, positions, ctx):
        return self.head(0, hidden, input_ids, positions, ctx, **self.embed_args(hidden))

    def draft_norm(self):
        # module 0's own shared_head.norm when the checkpoint has one, else the target's
        return self.head.final_norm(0, self.target)

    def draft_lm_head(self):
        return self.target.lm_head_weight, None  # shared with the target

    def draft_ids_from_lm_head(self, normed, also: tuple = ()):
        # = argmax of compute_logits (through the bf16 copy where there is one)
        if self._draft_lm_head is not None:
            with cpu_threads_for(normed):
                return argmax_rows(linear(normed, self._draft_lm_head, "lm_head_weight"),
                                   also=also)
        return self.target.greedy_tokens(normed, also=also)


def MTPProposer(spec, policy, target, model_cfg, runner_cfg):
    """Pick the MTP mode from the options and the number of modules in the checkpoint."""
    # the head's rope tables cover the positions the target's do
    weights = draft_weights(spec.draft_weight_dtype, runner_cfg)
    head = load_mtp_head(spec, model_cfg, runner_cfg, weights,
                         max_positions=target.rotary.max_positions,
                         tp=getattr(target, "tp", None))
    mode = spec.mtp_mode or ("eagle" if head.num_modules == 1 else "depths")
    if mode == "eagle":
        return MTPEagleProposer(spec, policy, target, head, lm_head_copies=weights.cpu_copies)
    if mode == "depths":
        if spec.num_speculative_tokens > head.num_modules:
            raise ConfigError(f"mtp_mode 'depths' drafts one token per module: the head has "
                              f"{head.num_modules} modules, so num_speculative_tokens must be "
                              f"<= {head.num_modules} (or use mtp_mode 'eagle')")
        from outpace.speculative.mtp_window import MTPWindowProposer
        return MTPWindowProposer(spec, policy, target, head)
    raise ConfigError(f"mtp_mode must be 'eagle' or 'depths', got {mode!r}")
