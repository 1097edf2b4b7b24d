"""`GraphMode`: which variant of the fused step's graphs a step replays (runner/fused_step.py,
runner/fused_prefill.py), as the four things a variant adds to the greedy graph.

Greedy, sampled and masked graphs share their keys (bucket, q, kd, chained) and differ only in
how a row's token is chosen from the LM head's logits: the argmax; the race of sample/gumbel.py
with each request's temperature and seed; or that race over the top-k / top-p / min-p nucleus.
The sampled and masked graphs also come with penalties (the rows penalized before the race:
runner/fused_penalties.py), and every one of these five families with logprobs (each row's
token's and its top MAX_LOGPROBS after accept, raw: runner/fused_sampling.py). That makes ten
modes (`MODES`); the three plain families (`BASE_MODES`) are captured at start-up, the others
when a request first needs them.

`graph_mode` is the one place a step's requests are turned into a mode, and it returns one of
the ten instances below: modes are dictionary keys (a graph table per mode, steps counted per
mode), so they are compared and hashed on every step launched from the host. A mode's `str`
(`sample+penalties+logprobs`) names it in logs, test ids and assertion messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from outpace.sample.logits_processing import SAMPLING_EPS


@dataclass(frozen=True, slots=True)
class GraphMode:
    """A fused graph's variant. samples: its rows race (fp32 logits, staged sampling rows)
    rather than take the argmax (greedy rows race with no noise there, which is their argmax);
    masks: the race is over the top-k / top-p / min-p nucleus; penalties: the rows are
    penalized before the race; logprobs: the graph returns each row's logprobs beside its
    tokens. Masks and penalties exist only in racing graphs (a greedy request with penalties
    takes the sampled graph with penalties)."""

    samples: bool = False
    masks: bool = False
    penalties: bool = False
    logprobs: bool = False

    def __post_init__(self):
        if (self.masks or self.penalties) and not self.samples:
            raise ValueError(f"masks and penalties need a racing graph: {self!r}")

    @property
    def name(self) -> str:
        """'greedy', 'sample' or 'masked', then '+penalties', then '+logprobs'."""
        family = "masked" if self.masks else "sample" if self.samples else "greedy"
        return (family + ("+penalties" if self.penalties else "")
                + ("+logprobs" if self.logprobs else ""))

    def __str__(self) -> str:
        return self.name


GREEDY = GraphMode()
SAMPLE = GraphMode(samples=True)
MASKED = GraphMode(samples=True, masks=True)
SAMPLE_PENALIZED = GraphMode(samples=True, penalties=True)
MASKED_PENALIZED = GraphMode(samples=True, masks=True, penalties=True)
BASE_MODES = (GREEDY, SAMPLE, MASKED)  # captured at start-up; the others when first needed
MODES = tuple(GraphMode(m.samples, m.masks, m.penalties, logprobs=True) if logprobs else m
              for m in (*BASE_MODES, SAMPLE_PENALIZED, MASKED_PENALIZED)
              for logprobs in (False, True))
# graph_mode returns these very instances (flags -> mode): a lookup of a mode in a table or in
# BASE_MODES then ends at the identity check before any field is compared
_BY_FLAGS = {(m.samples, m.masks, m.penalties, m.logprobs): m for m in MODES}


def graph_mode(params) -> GraphMode:
    """The graphs a step's requests (their SamplingParams) need: racing when any samples or
    asks for a penalty (greedy ones then race with no noise), with masks when a sampling one
    asks for top-k, top-p or min-p, with penalties when any asks for one, with logprobs when
    any asks for them."""
    samples = masks = penalties = logprobs = False
    for p in params:
        penalties = penalties or p.needs_penalties
        logprobs = logprobs or p.logprobs is not None
        if p.temperature >= SAMPLING_EPS:
            samples = True
            masks = masks or p.needs_masks
    return _BY_FLAGS[(samples or penalties, masks, penalties, logprobs)]
