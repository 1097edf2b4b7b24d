"""`SpecConfig`: speculative decoding's options (vLLM's `speculative_config`), each a typed field
validated here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from outpace.errors import ConfigError
from outpace.option_checks import check_int

SPEC_METHODS = ("ngram", "suffix", "mtp", "eagle3")
MAX_DRAFT_TOKENS = 16  # num_speculative_tokens at most (the verify graphs' query lengths)
# prompt_lookup_max at most with ngram_device: each n is one more compare of every position a
# row's lookup walks (kernels/ngram_lookup.py), or in the tensor-op reference one more pass
# over every row's whole history (speculative/ngram_device.py: O(bucket x max_model_len) work
# and a few graph nodes an n), while a suffix that long already pins its continuation: the
# longer n rarely names another occurrence.
NGRAM_DEVICE_MAX_N = 8
# The model-free drafters' k_schedule on CUDA when none is given (`with_default_schedule`):
# they draft while at most this many requests run or wait and not above, where their steps
# cost more than their acceptance on chat prompts returns (docs/decisions.md).
MODEL_FREE_MAX_BATCH = 16


def _int(name, v, lo=None, optional=False):
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or (lo is not None and v < lo):
        raise ConfigError(f"speculative option {name!r} must be an integer"
                          + (f" >= {lo}" if lo is not None else "") + f", got {v!r}")
    return v


def _ids(name, v):
    """A token id or a list of them -> tuple (their range is checked against the vocabulary
    when the engine is built)."""
    if v is None:
        return None
    v = [v] if isinstance(v, int) and not isinstance(v, bool) else v
    if (not isinstance(v, (list, tuple)) or not v
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v)):
        raise ConfigError(f"{name} must be a token id or a list of token ids, got {v!r}")
    return tuple(v)


RELAXED_OPTIONS = ("relaxed_top_k", "relaxed_delta", "think_begin_ids", "think_end_ids")
DRAFT_WEIGHT_DTYPES = ("auto", "float32", "bfloat16")  # SpecConfig.draft_weight_dtype


def check_draft_weight_dtype(choice: str, activations: str) -> None:
    """draft_weight_dtype against the engine's activation dtype (a name): a draft head's
    weights may be read narrower than the activations, never wider, and a 16-bit dtype only
    under its own or float32 (neither 16-bit format holds all of the other's values)."""
    if choice not in DRAFT_WEIGHT_DTYPES:
        raise ConfigError(f"draft_weight_dtype must be one of {', '.join(DRAFT_WEIGHT_DTYPES)}, "
                          f"got {choice!r}", option="draft_weight_dtype")
    if choice == "auto" or choice == activations or activations == "float32":
        return
    why = ("is wider than" if choice == "float32" else
           "does not hold every value of")
    raise ConfigError(f"draft_weight_dtype {choice} {why} the engine's dtype {activations}: a "
                      f"draft head's weights may be read narrower than the activations, never "
                      f"wider; use auto", option="draft_weight_dtype")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (vLLM-shaped `speculative_config`). method=None: off. Every option
    is a typed field, validated here; docs/configuration.md describes each."""

    method: Optional[str] = None
    model: Optional[str] = None  # draft head folder (mtp, eagle3)
    num_speculative_tokens: int = 3
    # n-gram prompt lookup (vLLM's names): the longest and shortest n-gram matched
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # the lookup inside the fused CUDA graphs (runner/fused_ngram.py), so n-gram steps chain;
    # off: on the host after each step's output copy (steps relaunched, not chained). None:
    # on where the graphs run it as the Triton kernel and the other options allow it
    # (`with_ngram_device`), since a host lookup delays every step it drafts for
    ngram_device: Optional[bool] = None
    # suffix decoding
    suffix_min_match_len: int = 1
    suffix_max_match_len: int = 64
    suffix_cache_requests: Optional[int] = None  # finished requests kept as a global cache
    suffix_periodic: bool = False
    # draft length: ((max_batch_size, k), ...) -> k at that batch size (0 beyond the last);
    # None: every batch size, but n-gram and suffix on CUDA (`with_default_schedule`);
    # adaptive: each request's k follows its own acceptance (true: up or down by one a step;
    # "cost": the cost model picks every request's k in 0..k for the most tokens per second
    # of measured step time, speculative/cost_model.py)
    k_schedule: Optional[tuple] = None
    adaptive: Union[bool, str] = False
    # draft heads
    enhancer_min_match: Optional[int] = None  # suffix drafts replace the head's at this match
    mtp_mode: Optional[str] = None  # "eagle" | "depths"; None: eagle for one module, else depths
    draft_lm_head_dtype: str = "auto"  # "int8": drafts from an int8 copy of the draft LM head
    # the head's matrices: "auto" reads them as bf16 on a CPU with bf16 instructions under
    # float32 activations, else as the target's weights; "float32" / "bfloat16" force it
    # (models/draft_weights.py). Drafts only: the output is the target's either way.
    draft_weight_dtype: str = "auto"
    # relaxed acceptance inside thinking spans (all four or none)
    relaxed_top_k: Optional[int] = None
    relaxed_delta: Optional[float] = None
    think_begin_ids: Optional[tuple] = None
    think_end_ids: Optional[tuple] = None
    # Benchmarking only: accept drafts at random with this mean acceptance length, to time
    # the speculative step apart from a head's quality (output is then not the target's).
    force_accept_mean: Optional[float] = None
    # Testing only: every n-th propose call raises (speculative/injected_failures.py), to
    # exercise what the engine does after a drafter fails (output unchanged, the draft plane
    # repaired, the failure counted and logged).
    inject_draft_failures: Optional[int] = None
    # Testing only: after every fused step (launched or chained) the slots its graph wrote,
    # target rows and draft loop alike, are read back and checked against the blocks the
    # scheduler reserved for each request (runner/write_check.py); a step syncs the device.
    check_fused_writes: bool = False

    def __post_init__(self):
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ConfigError(f"method {self.method!r} is unknown; use one of "
                              f"{', '.join(SPEC_METHODS)} (speculative decoding methods)",
                              option="method")
        check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_DRAFT_TOKENS,
                  why=" (draft tokens per step)")
        if self.method in ("mtp", "eagle3") and not self.model:
            raise ConfigError(f"speculative method {self.method!r} needs a draft head folder "
                              f"(speculative_config['model'])",
                              option="speculative_config['model']")
        if self.model is not None and self.method in ("ngram", "suffix"):
            raise ConfigError(f"method {self.method!r} drafts from the text itself and "
                              f"takes no draft head folder (speculative_config['model']); leave it "
                              f"out, or use eagle3 or mtp",
                              option="speculative_config['model']")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError(f"speculative_config['model'] must be the path of a draft head "
                              f"folder, got {self.model!r}", option="speculative_config['model']")
        _int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _int("prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                              f"prompt_lookup_max ({self.prompt_lookup_max})")
        _int("suffix_min_match_len", self.suffix_min_match_len, 1)
        _int("suffix_max_match_len", self.suffix_max_match_len, 1)
        _int("suffix_cache_requests", self.suffix_cache_requests, 0, optional=True)
        _int("enhancer_min_match", self.enhancer_min_match, 0, optional=True)
        _int("inject_draft_failures", self.inject_draft_failures, 1, optional=True)
        for name in ("suffix_periodic", "adaptive", "ngram_device"):
            if ((name == "adaptive" and self.adaptive == "cost")
                    or (name == "ngram_device" and self.ngram_device is None)):
                continue
            if getattr(self, name) in (0, 1) and not isinstance(getattr(self, name), float):
                object.__setattr__(self, name, bool(getattr(self, name)))  # 1 / 0 as JSON has them
            if not isinstance(getattr(self, name), bool):
                allowed = ('true, false or "cost" (the draft-length cost model)'
                           if name == "adaptive" else "true or false")
                raise ConfigError(f"speculative option {name!r} must be {allowed}, got "
                                  f"{getattr(self, name)!r}")
        if self.ngram_device and self.method != "ngram":
            raise ConfigError(f"speculative option 'ngram_device' is the n-gram lookup in the "
                              f"fused graphs; it needs method 'ngram', got {self.method!r}",
                              option="ngram_device")
        if self.ngram_device and self.prompt_lookup_max > NGRAM_DEVICE_MAX_N:
            raise ConfigError(f"speculative option 'prompt_lookup_max' must be at most "
                              f"{NGRAM_DEVICE_MAX_N} with 'ngram_device': true (each n is a "
                              f"pass over every row's whole history in every step), got "
                              f"{self.prompt_lookup_max}", option="prompt_lookup_max")
        if self.ngram_device and self.adaptive is not False:
            raise ConfigError(f"speculative option 'ngram_device' drafts one length for the "
                              f"whole batch in the graph; it needs 'adaptive': false, got "
                              f"{self.adaptive!r}", option="ngram_device")
        if self.k_schedule is not None:
            try:
                pairs = tuple(sorted((int(b), int(v)) for b, v in self.k_schedule))
            except (TypeError, ValueError):
                raise ConfigError("k_schedule must be a list of [max_batch_size, k] pairs, "
                                  "e.g. [[8, 4], [32, 2], [64, 1]]") from None
            k = self.num_speculative_tokens
            if any(b < 1 or not 0 <= v <= k for b, v in pairs):
                raise ConfigError(f"k_schedule entries need max_batch_size >= 1 and "
                                  f"0 <= k <= {k}")
            object.__setattr__(self, "k_schedule", pairs)
        if self.mtp_mode not in (None, "eagle", "depths"):
            raise ConfigError(f"mtp_mode must be 'eagle' (one module applied k times) or "
                              f"'depths' (one module a depth), got {self.mtp_mode!r}")
        if self.draft_lm_head_dtype not in ("auto", "int8"):
            raise ConfigError(f"draft_lm_head_dtype must be 'auto' (the head's dtype) or "
                              f"'int8', got {self.draft_lm_head_dtype!r}")
        check_draft_weight_dtype(self.draft_weight_dtype, "float32")  # (its name; the dtype
        # against the engine's once that is known: preflight, models/draft_weights.py)
        if self.draft_weight_dtype != "auto" and self.method not in ("eagle3", "mtp"):
            raise ConfigError(f"draft_weight_dtype is a draft head's; method {self.method!r} "
                              f"has none: leave it out", option="draft_weight_dtype")
        given = [k for k in RELAXED_OPTIONS if getattr(self, k) is not None]
        if given:
            missing = [k for k in RELAXED_OPTIONS if k not in given]
            if missing:
                raise ConfigError(f"relaxed acceptance needs all of {list(RELAXED_OPTIONS)}; "
                                  f"missing {missing} (it only applies inside a thinking span, "
                                  f"so the span's begin and end token ids are required)")
            _int("relaxed_top_k", self.relaxed_top_k, 1)
            d = self.relaxed_delta
            if not isinstance(d, (int, float)) or isinstance(d, bool) or not 0.0 <= d <= 1.0:
                raise ConfigError(f"relaxed_delta must be a number in [0, 1], got {d!r}")
            object.__setattr__(self, "relaxed_delta", float(d))
            for name in ("think_begin_ids", "think_end_ids"):
                object.__setattr__(self, name, _ids(name, getattr(self, name)))
        m = self.force_accept_mean
        if m is not None and (not isinstance(m, (int, float)) or isinstance(m, bool) or m < 1):
            raise ConfigError(f"force_accept_mean must be a number >= 1 (a mean acceptance "
                              f"length, the bonus token included), got {m!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def relaxed(self) -> bool:
        return self.relaxed_top_k is not None

    def with_ngram_device(self, lookup_kernel: bool) -> "SpecConfig":
        """This config with `ngram_device` decided (None: on for method ngram where the fused
        graphs run the lookup as the Triton kernel (`lookup_kernel`), with `adaptive` false and
        `prompt_lookup_max` within NGRAM_DEVICE_MAX_N, and without relaxed acceptance, whose
        steps leave the fused graphs with the device lookup (FusedStep.accepts); else off).
        A set value stays."""
        if self.ngram_device is not None:
            return self
        on = (lookup_kernel and self.method == "ngram" and self.adaptive is False
              and self.prompt_lookup_max <= NGRAM_DEVICE_MAX_N and not self.relaxed)
        return dataclasses.replace(self, ngram_device=on)

    def with_default_schedule(self, cuda: bool) -> "SpecConfig":
        """This config with the model-free drafters' default `k_schedule` on CUDA: method ngram
        or suffix, no k_schedule given and `adaptive` false -> drafting k while at most
        MODEL_FREE_MAX_BATCH requests run or wait (StepPlan.draft_batch_size), none above. A
        given schedule, the adaptive and cost choices, the draft heads and other devices keep
        theirs."""
        if (not cuda or self.k_schedule is not None or self.adaptive is not False
                or self.method not in ("ngram", "suffix")):
            return self
        return dataclasses.replace(
            self, k_schedule=((MODEL_FREE_MAX_BATCH, self.num_speculative_tokens),))

    @staticmethod
    def from_dict(d: Optional[dict]) -> "SpecConfig":
        """A vLLM-shaped speculative_config dict -> SpecConfig; unknown keys are an error."""
        if not d:
            return SpecConfig()
        known = [f.name for f in dataclasses.fields(SpecConfig)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(f"unknown speculative option(s) {unknown}; known: "
                              f"{sorted(known)}")
        return SpecConfig(**d)
