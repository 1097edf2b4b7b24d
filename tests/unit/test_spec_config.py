"""SpecConfig: every speculative option a typed field, validated when the config is made."""

from __future__ import annotations

import pytest

from outpace.errors import ConfigError
from outpace.speculative_config import SpecConfig


def test_defaults_and_typed_values():
    s = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                              "k_schedule": [[32, 2], [8, 4]], "think_begin_ids": 5,
                              "think_end_ids": [6, 7], "relaxed_top_k": 3,
                              "relaxed_delta": 1})
    assert s.prompt_lookup_min == 1 and s.prompt_lookup_max == 4 and not s.adaptive
    assert s.k_schedule == ((8, 4), (32, 2))  # sorted pairs, hashable
    assert s.think_begin_ids == (5,) and s.think_end_ids == (6, 7)
    assert s.relaxed and s.relaxed_delta == 1.0 and isinstance(s.relaxed_delta, float)
    assert s.force_accept_mean is None and s.mtp_mode is None
    hash(s)


@pytest.mark.parametrize("d,msg", [
    ({"method": "ngram", "lookahead": 3}, r"unknown speculative option\(s\) \['lookahead'\]; "
                                          r"known: .*'prompt_lookup_max'"),
    ({"prompt_lookup_max": 0}, "'prompt_lookup_max' must be an integer >= 1"),
    ({"suffix_periodic": "yes"}, "'suffix_periodic' must be true or false"),
    ({"adaptive": 2}, "'adaptive' must be true, false or \"cost\""),
    ({"adaptive": "costs"}, "'adaptive' must be true, false or \"cost\""),
    ({"suffix_cache_requests": -1}, "'suffix_cache_requests' must be an integer >= 0"),
    ({"k_schedule": [[8, 5]]}, r"0 <= k <= 3"),
    ({"k_schedule": "fast"}, "k_schedule must be a list of"),
    ({"mtp_mode": "tree"}, "mtp_mode must be 'eagle'"),
    ({"draft_lm_head_dtype": "int4"}, "draft_lm_head_dtype must be 'auto'"),
    ({"relaxed_top_k": 4}, r"relaxed acceptance needs all of .*missing \['relaxed_delta'"),
    ({"relaxed_top_k": 4, "relaxed_delta": 2, "think_begin_ids": [1], "think_end_ids": [2]},
     r"relaxed_delta must be a number in \[0, 1\]"),
    ({"relaxed_top_k": 4, "relaxed_delta": 0.5, "think_begin_ids": [], "think_end_ids": [2]},
     "think_begin_ids must be a token id or a list"),
    ({"force_accept_mean": 0.5}, "force_accept_mean must be a number >= 1"),
    ({"inject_draft_failures": 0}, "'inject_draft_failures' must be an integer >= 1"),
    ({"inject_draft_failures": "often"}, "'inject_draft_failures' must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": "3"},
     "num_speculative_tokens must be an integer in 1..16"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens must be an "
                                                        "integer in 1..16 .draft tokens"),
    ({"method": "beam"}, "method 'beam' is unknown; use one of ngram, suffix, mtp, eagle3"),
])
def test_bad_options_are_clear_errors(d, msg):
    with pytest.raises(ConfigError, match=msg):
        SpecConfig.from_dict(d)


def test_draft_positions_stay_within_the_rope_tables():
    """A draft loop reaches at most k positions past the context's end (models/rotary.py): the
    bound on num_speculative_tokens keeps them inside the tables' margin, so no head drafts at a
    position its (or the target's) rope tables lack."""
    from outpace.models.rotary import POSITION_MARGIN
    from outpace.speculative_config import MAX_DRAFT_TOKENS
    assert MAX_DRAFT_TOKENS <= POSITION_MARGIN
    with pytest.raises(ConfigError, match="num_speculative_tokens must be an integer in 1..16"):
        SpecConfig(method="ngram", num_speculative_tokens=MAX_DRAFT_TOKENS + 1)


def test_prompt_lookup_max_is_bounded_with_ngram_device():
    """The device lookup makes a pass over every row's history per n, in every step: with
    ngram_device, prompt_lookup_max is at most NGRAM_DEVICE_MAX_N, the error naming both."""
    from outpace.speculative_config import NGRAM_DEVICE_MAX_N
    top = NGRAM_DEVICE_MAX_N
    ngram = {"method": "ngram", "ngram_device": True}
    assert SpecConfig.from_dict({**ngram, "prompt_lookup_max": top}).prompt_lookup_max == top
    with pytest.raises(ConfigError, match=rf"'prompt_lookup_max' must be at most {top} with "
                                          rf"'ngram_device': true .*got {top + 1}") as err:
        SpecConfig.from_dict({**ngram, "prompt_lookup_max": top + 1})
    assert err.value.option == "prompt_lookup_max"
    assert top == 8
    # on the host the lookup keeps an index: no bound there
    assert SpecConfig.from_dict({"method": "ngram", "prompt_lookup_max": 64}).prompt_lookup_max \
        == 64


def test_ngram_device_default_follows_the_lookup_kernel():
    """ngram_device unset (None) is decided by the engine: on for method ngram where the
    graphs run the lookup as the Triton kernel and the options allow the device lookup, off
    otherwise; a value the user set is kept either way."""
    from outpace.speculative_config import NGRAM_DEVICE_MAX_N
    ngram = SpecConfig(method="ngram")
    assert ngram.ngram_device is None
    assert ngram.with_ngram_device(True).ngram_device is True
    assert ngram.with_ngram_device(False).ngram_device is False
    # the options the device lookup refuses when set keep it off when unset, and relaxed
    # acceptance, whose steps would leave the fused graphs with it
    relaxed = {"relaxed_top_k": 3, "relaxed_delta": 0.5, "think_begin_ids": 5,
               "think_end_ids": 6}
    for other in ({"adaptive": True}, {"adaptive": "cost"},
                  {"prompt_lookup_max": NGRAM_DEVICE_MAX_N + 1}, relaxed):
        assert SpecConfig(method="ngram", **other).with_ngram_device(True).ngram_device is False
    for method, extra in (("suffix", {}), ("eagle3", {"model": "h"}), (None, {})):
        assert SpecConfig(method=method, **extra).with_ngram_device(True).ngram_device is False
    assert SpecConfig(method="ngram", ngram_device=False).with_ngram_device(True).ngram_device \
        is False
    assert SpecConfig(method="ngram", ngram_device=True).with_ngram_device(False).ngram_device \
        is True


def test_model_free_drafters_get_a_k_schedule_on_cuda():
    """No k_schedule given: n-gram and suffix on CUDA draft k while at most MODEL_FREE_MAX_BATCH
    requests run or wait and none above; a given schedule, the adaptive and cost choices, the
    draft heads and the CPU keep theirs."""
    from outpace.speculative_config import MODEL_FREE_MAX_BATCH as B
    for method in ("ngram", "suffix"):
        s = SpecConfig(method=method, num_speculative_tokens=5)
        assert s.k_schedule is None
        assert s.with_default_schedule(True).k_schedule == ((B, 5),)
        assert s.with_default_schedule(False).k_schedule is None
        given = SpecConfig.from_dict({"method": method, "k_schedule": [[64, 3]]})
        assert given.with_default_schedule(True).k_schedule == ((64, 3),)
        for adaptive in (True, "cost"):
            assert SpecConfig(method=method, adaptive=adaptive).with_default_schedule(
                True).k_schedule is None
    for method in ("eagle3", "mtp"):
        assert SpecConfig(method=method, model="h").with_default_schedule(True).k_schedule \
            is None
    assert SpecConfig().with_default_schedule(True).k_schedule is None
