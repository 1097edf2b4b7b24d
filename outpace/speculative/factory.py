"""Builds the proposer for a SpecConfig (one proposer class per method)."""

from __future__ import annotations

from outpace.errors import ConfigError
from outpace.speculative.draft_length import DraftLengthPolicy
from outpace.speculative_config import SpecConfig

def build_proposer(spec: SpecConfig, target, model_cfg, runner_cfg):
    policy = DraftLengthPolicy(spec.num_speculative_tokens, schedule=spec.k_schedule,
                               adaptive=spec.adaptive)
    if spec.method == "ngram":
        from outpace.speculative.model_free import NgramProposer
        p = NgramProposer(policy, spec)
    elif spec.method == "suffix":
        from outpace.speculative.model_free import SuffixProposer
        p = SuffixProposer(policy, spec)
    elif spec.method == "eagle3":
        from outpace.speculative.eagle3 import Eagle3Proposer
        p = Eagle3Proposer(spec, policy, target, model_cfg, runner_cfg)
    elif spec.method == "mtp":
        from outpace.speculative.mtp import MTPProposer
        p = MTPProposer(spec, policy, target, model_cfg, runner_cfg)
    else:  # SpecConfig validated the name already
        raise ConfigError(f"unknown speculative method {spec.method!r}")
    p.k = spec.num_speculative_tokens
    p.spec = spec
    policy.seed_prior(p.acceptance_prior)
    # Lookahead (docs/design.md, "Scheduling and lookahead reservation"): a head's draft loop
    # writes draft KV up to k-1 positions past the verify block; model-free drafters write
    # nothing.
    p.num_lookahead_tokens = max(0, spec.num_speculative_tokens - 1) if p.num_kv_layers else 0
    return p
