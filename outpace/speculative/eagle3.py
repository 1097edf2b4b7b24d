"""EAGLE-3 proposer: fuse three captured target layers, then chain-draft with one layer.

The target exposes the residual stream after layers (1, L/2-1, L-4) (or the head config's ids)
for every row of the step; `fc` fuses them into the head's input hidden (docs/design.md,
"EAGLE-3 feature capture"). Drafts come from the head's reduced vocabulary, mapped to target ids
by `d2t`.
"""

from __future__ import annotations

from outpace.speculative.head_proposer import HeadProposer


class Eagle3Proposer(HeadProposer):
    def __init__(self, spec, policy, target, model_cfg, runner_cfg):
        super().__init__(policy, target, spec)
        from outpace.models.draft_loader import load_draft_head
        from outpace.models.draft_weights import draft_weights
        weights = draft_weights(spec.draft_weight_dtype, runner_cfg)
        # the head's rope tables cover the positions the target's do
        self.head = load_draft_head("eagle3", spec.model, model_cfg,
                                    first_layer_slot=model_cfg.num_hidden_layers,
                                    dtype=runner_cfg.torch_dtype, device=runner_cfg.device,
                                    weight_dtype=weights.stored,
                                    cpu_copies=weights.cpu_copies,
                                    max_positions=target.rotary.max_positions,
                                    tp=getattr(target, "tp", None))
        self.num_kv_layers = 1
        self.capture_layers = tuple(self.head.aux_layer_ids)

    def first_hidden(self, batch):
        return self.head.fuse(batch.aux_hidden)  # 3 x [T, H] -> [T, H]

    def step(self, hidden, input_ids, positions, ctx):
        return self.head(hidden, input_ids, positions, ctx, **self.embed_args(hidden))

    def draft_norm(self):
        return self.head.norm

    def draft_lm_head(self):
        return self.head.lm_head_weight, self.head.d2t

    def draft_ids_from_lm_head(self, normed, also: tuple = ()):
        # argmax and d2t in one kernel on CUDA
        return self.head.greedy_target_ids_normed(normed, also=also)
