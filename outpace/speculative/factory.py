"""Builds the proposer for a SpecConfig (one proposer class per method)."""

from __future__ import annotations

from outpace.config import SpecConfig
from outpace.errors import ConfigError
from outpace.speculative.draft_length import DraftLengthPolicy

KNOWN_OPTIONS = {
    "prompt_lookup_min", "prompt_lookup_max",  # ngram
    "suffix_min_match_len", "suffix_max_match_len", "suffix_cache_requests", "suffix_periodic",
    "k_schedule", "adaptive",  # draft length
    "force_accept_mean",  # benchmarks only: accept drafts at random with this mean length
    "enhancer_min_match",  # heads: suffix drafts replace the head's when the match is this long
    "relaxed_top_k", "relaxed_delta", "think_begin_ids", "think_end_ids",  # relaxed acceptance
    "mtp_mode",  # "eagle" (one module applied k times) or "depths" (D modules)
    "draft_lm_head_dtype",  # heads: "int8" drafts from an int8 copy of the draft LM head
}


def build_proposer(spec: SpecConfig, target, model_cfg, runner_cfg):
    unknown = set(spec.options) - KNOWN_OPTIONS
    if unknown:
        raise ConfigError(f"unknown speculative option(s) {sorted(unknown)}; known: "
                          f"{sorted(KNOWN_OPTIONS)}")
    opts = spec.options
    policy = DraftLengthPolicy(spec.num_speculative_tokens, schedule=opts.get("k_schedule"),
                               adaptive=bool(opts.get("adaptive", False)))
    if spec.method == "ngram":
        from outpace.speculative.model_free import NgramProposer
        p = NgramProposer(policy, opts)
    elif spec.method == "suffix":
        from outpace.speculative.model_free import SuffixProposer
        p = SuffixProposer(policy, opts)
    elif spec.method == "eagle3":
        from outpace.speculative.eagle3 import Eagle3Proposer
        p = Eagle3Proposer(spec, policy, target, model_cfg, runner_cfg)
    elif spec.method == "mtp":
        from outpace.speculative.mtp import MTPProposer
        p = MTPProposer(spec, policy, target, model_cfg, runner_cfg)
    else:  # SpecConfig validated the name already
        raise ConfigError(f"unknown speculative method {spec.method!r}")
    p.k = spec.num_speculative_tokens
    p.options = opts
    # Lookahead (docs/design.md, "Scheduling and lookahead reservation"): a head's draft loop
    # writes draft KV up to k-1 positions past the verify block; model-free drafters write
    # nothing.
    p.num_lookahead_tokens = max(0, spec.num_speculative_tokens - 1) if p.num_kv_layers else 0
    return p
