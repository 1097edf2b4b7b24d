"""The objects that cross the engine/runner boundary, and the user-facing request types.

Request      one generation, owned by the scheduler; the runner reads it.
StepPlan     scheduler -> runner: which requests run this step and how many tokens each.
StepResult   runner -> engine: the tokens each request committed this step (and new drafts).
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Optional

from outpace.errors import InvalidRequestError

OUTPUT_KINDS = ("cumulative", "final_only")
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
MAX_LOGPROBS = 20  # SamplingParams.logprobs' largest (vLLM's max_logprobs default)
# Per-request list bounds: a request's lists are checked every token on the engine's thread, so
# their size must not let one request slow everyone else's steps.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024


@dataclass
class SamplingParams:
    """vLLM-shaped sampling parameters. Validated on construction."""

    max_tokens: Optional[int] = 16  # None: up to the context length
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: Optional[int] = None
    stop: list = field(default_factory=list)  # stop strings, cut from the text
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # top-n logprobs per output token (0: only the chosen one)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    # "cumulative": an output every step while the request runs (streaming); "final_only": only
    # the finished one (offline generation: LLM.generate), which spares the engine building a
    # RequestOutput per request per step. vLLM's RequestOutputKind.CUMULATIVE / FINAL_ONLY.
    output_kind: str = "cumulative"
    # False: the engine leaves the output's text empty and checks no stop strings (vLLM's
    # `detokenize`); whoever reads the token ids detokenizes them (the server's front end,
    # beside an engine-core process: engine/output_processor.py).
    detokenize: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self):
        def bad(option, msg):
            raise InvalidRequestError(msg, option=option)

        def is_num(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if self.n != 1:
            bad("n", f"n={self.n} is not supported; outpace returns one completion per request "
                f"(n=1)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            bad("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_num(self.temperature) or self.temperature < 0:
            bad("temperature", f"temperature must be >= 0, got {self.temperature!r}")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_p < FLOAT32_TINY:  # the kernels compare in float32, where it would be 0
            bad("top_p", f"top_p must be at least {FLOAT32_TINY:.3g} (the smallest normal "
                f"float32, the precision sampling runs in), got {self.top_p!r}; for the top "
                f"token alone use temperature 0 or top_k 1")
        if (not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0
                or self.top_k >= 1 << 31):
            bad("top_k", f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2.0 <= v <= 2.0:
                bad(name, f"{name} must be in [-2, 2], got {v!r}")
        # signed or unsigned 64-bit, as the OpenAI server takes them (the race keys on the
        # seed's 64 bits: sample/gumbel.py)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -(1 << 63) <= self.seed < 1 << 64):
            bad("seed", f"seed must fit in 64 bits (-2**63 .. 2**64 - 1), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are "
                f"allowed")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "stop must be a non-empty string or a list of non-empty strings")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            bad("stop", f"each stop string may have at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"stop_token_ids has {len(self.stop_token_ids)} entries; at "
                f"most {MAX_STOP_TOKEN_IDS} are allowed")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                   for t in self.stop_token_ids):
            bad("stop_token_ids", "stop_token_ids must be a list of non-negative integers")
        if not isinstance(self.detokenize, bool):
            bad("detokenize", f"detokenize must be true or false, got {self.detokenize!r}")
        if self.stop and not self.detokenize:
            bad("stop", "stop strings are matched in the detokenized text: with "
                "detokenize=False leave stop empty (and match them where the text is made)")
        if self.output_kind not in OUTPUT_KINDS:
            bad("output_kind", f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got "
                f"{self.output_kind!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"logprobs must be an integer in 0..{MAX_LOGPROBS}, got "
                f"{self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def needs_masks(self) -> bool:
        """Top-k, top-p or min-p asked for (they act only when the request samples)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class SpecStats:
    """Speculative decoding counters of one request (or, summed, of the engine)."""

    num_drafts: int = 0  # verify steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list = field(default_factory=list)  # [k]: accepted at draft index i

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step, bonus included: 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position.extend([0] * (num_draft - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: "SpecStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        n = len(other.accepted_per_position)
        if len(self.accepted_per_position) < n:
            self.accepted_per_position.extend([0] * (n - len(self.accepted_per_position)))
        for i, v in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += v

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "mean_acceptance_length": self.mean_acceptance_length,
                "acceptance_rate": self.acceptance_rate}


@dataclass
class Request:
    """One generation. The scheduler owns it; the runner only reads it."""

    request_id: str
    prompt_token_ids: list
    sampling_params: SamplingParams
    eos_token_ids: tuple = ()
    max_model_len: int = 1 << 30
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: Optional[str] = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)  # per output token: (logprob, {id: lp})
    num_computed_tokens: int = 0  # tokens whose KV is in the pool (target plane)
    # draft-plane entries of positions below this are exact (docs/glossary.md, "draft-plane
    # mark"); the scheduler keeps num_computed_tokens from passing it
    num_draft_exact_tokens: int = 0
    draft_repair_mark: int = -1  # the mark a drafter failure last recomputed it from
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    num_preemptions: int = 0
    spec_token_ids: list = field(default_factory=list)  # drafts to verify in the next step
    spec_stats: SpecStats = field(default_factory=SpecStats)
    stop_reason: object = None  # the stop string or token id that ended it
    # time.monotonic() of its first admission into a step (preemption's resumes are not
    # admissions anew): its waiting ends there, its prefill begins
    scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None

    def __post_init__(self):
        # the stop ids as a set: each new token is checked against it in O(1)
        self.stop_id_set = frozenset(self.sampling_params.stop_token_ids)

    @property
    def all_token_ids(self) -> list:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list:
        """all_token_ids[start:stop] without building all_token_ids (0 <= start <= stop)."""
        p, lp = self.prompt_token_ids, len(self.prompt_token_ids)
        if start >= lp:
            return self.output_token_ids[start - lp:stop - lp]
        if stop <= lp:
            return p[start:stop]
        return p[start:] + self.output_token_ids[:stop - lp]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.value if self.status.finished else None


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    The step computes KV for tokens [num_computed_tokens, num_computed_tokens + num_new_tokens)
    of `request.all_token_ids + draft_token_ids`. When `sample` is set, the last position (and,
    with drafts, every draft position) gets logits.
    """

    request: Request
    num_computed_tokens: int  # before this step
    num_new_tokens: int  # tokens computed this step, drafts included
    draft_token_ids: list = field(default_factory=list)  # verified this step
    sample: bool = True  # False for a prefill chunk that doesn't reach the end of the prompt
    # the request's block table, filled by the engine for the plans the runner builds a batch
    # from (a chained step's plan, launched from the device, has none)
    block_ids: list = field(default_factory=list)


@dataclass
class StepPlan:
    scheduled: list = field(default_factory=list)  # [ScheduledRequest]
    preempted_ids: list = field(default_factory=list)
    # Requests running or waiting when the step was planned, at most max_num_seqs (0: not
    # recorded). The draft-length schedule reads it (draft_batch_size): under a queue the decode
    # batches are about to grow, and drafting for the few requests of a ramp-up step would be
    # verified at the full batch; they never grow past max_num_seqs.
    load: int = 0

    @property
    def draft_batch_size(self) -> int:
        """The batch size the k schedule is asked about: this step's requests, or the load
        when more are running or waiting."""
        return max(len(self.scheduled), self.load)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RequestStepOutput:
    """What one request committed in one step."""

    token_ids: list  # accepted drafts then the recovered/bonus token; [] for a mid-prompt chunk
    logprobs: Optional[list] = None  # per token: (logprob, {token_id: logprob} top-n)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    next_draft_token_ids: list = field(default_factory=list)  # drafts for the next step
    # False: the drafter raised in this step, so the draft plane's entries for this step's rows
    # may be stale (the scheduler then recomputes from Request.num_draft_exact_tokens)
    draft_plane_written: bool = True
    # True: the head ran no draft work for this request in this step (its draft length was 0),
    # so the plane's entries for this step's rows were not written; the mark stays and the
    # repair waits until the request drafts again (Scheduler._draft_plane_mark)
    draft_plane_skipped: bool = False


@dataclass
class StepResult:
    outputs: dict = field(default_factory=dict)  # request_id -> RequestStepOutput
    num_draft_failures: int = 0  # drafter calls of this step that raised


@dataclass
class CompletionOutput:
    text: str
    token_ids: list
    finish_reason: Optional[str] = None
    stop_reason: object = None
    logprobs: Optional[list] = None  # per token: {token_id: logprob} incl. the chosen one


@dataclass
class RequestOutput:
    """vLLM-shaped result of one request; `outs[0].text` and `.token_ids` are shortcuts."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    outputs: list  # [CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    spec_stats: Optional[SpecStats] = None
    metrics: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> Optional[str]:
        return self.outputs[0].finish_reason
