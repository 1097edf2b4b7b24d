"""`GraphTable`, the fused step's captured graphs: per GraphMode, (bucket, q, kd, chained) ->
(graph, its outputs); which keys are captured at start-up (`capture_common`) and which the
first time they are launched (`capture_later`), each with the steps that follow it (the chained
step, the relaunched ones), since chain and relaunch never capture: a step is in flight then.
"""

from __future__ import annotations

from outpace.runner.graph_mode import BASE_MODES, GREEDY, MODES, GraphMode


class GraphTable:
    """A part of FusedStep: `step` is the FusedStep that owns it (a weak proxy), whose
    buffers a graph is captured over (`fill_dummy`) and whose body it captures (`compute`)."""

    def __init__(self, step):
        self.step = step
        # the greedy graphs, sampled ones, sampled with masks, those two with penalties, and
        # each of these with logprobs (graph_mode.MODES)
        self.by_mode = {mode: {} for mode in MODES}
        self.captures = 0  # graphs captured so far (benchmarks tell a timed run that captured)

    @property
    def greedy(self) -> dict:
        return self.by_mode[GREEDY]

    def successors(self, bucket: int, kd: int) -> list:
        """The keys of the steps launched from a step of (bucket, any q, kd) on the device: the
        chained step (q = kd + 1 drafts-and-bonus; its own loop kd again, and under the cost
        model also 0: the choice falling to no drafts chains too) and the relaunched ones of a
        host drafter or a head with the suffix enhancer."""
        step, q_lens = self.step, self.step.graphs.q_lens
        keys = []
        if step.chainable and step.next_q(kd) in q_lens:
            loops = (kd, 0) if step.lengths.follows_choice and kd else (kd,)
            keys += [(bucket, step.next_q(kd), k, True) for k in loops]
        if step.relaunchable:  # (a head's, with the enhancer, drafts kd again)
            keys += [(bucket, q, kd, True) for q in q_lens]
        return keys

    def capture_common(self) -> None:
        """Capture ahead what steady decoding uses: every bucket x every verify length, with
        the draft-loop length such a steady step runs (StepDraftLengths.steady_kd: the policy's
        k for that bucket, or under the cost model one draft fewer than the verify length), and
        the steps that follow. Others are captured when first seen."""
        step = self.step
        for bucket in reversed(step.graphs.buckets):
            keys = [(bucket, q, step.lengths.steady_kd(bucket, q), False)
                    for q in step.graphs.q_lens]
            for kd in sorted({key[2] for key in keys}, reverse=True):
                keys += self.successors(bucket, kd)
            for key in keys:
                for mode in BASE_MODES:
                    table = self.by_mode[mode]
                    if key not in table:
                        table[key] = self.capture(*key, mode=mode)

    def capture_later(self, key: tuple, mode: GraphMode) -> None:
        """Capture a graph when its key is first launched (a launch from the host: nothing is
        in flight), with the steps that follow it for a mode not captured at start-up
        (penalties, logprobs), or a draft-loop length the cost model chose that start-up did
        not capture."""
        self.step.runner.step_clock.interrupt()  # a capture is not a step's time
        if mode in BASE_MODES and not self.step.lengths.follows_choice:
            self.by_mode[mode][key] = self.capture(*key, mode=mode)
            return
        if mode.penalties:
            self.step.penalties.ensure_tables()
        bucket, _, kd, _ = key
        table = self.by_mode[mode]
        for k in [key] + self.successors(bucket, kd):
            if k not in table:
                table[k] = self.capture(*k, mode=mode)

    def capture(self, bucket: int, q: int, kd: int, chained: bool, mode: GraphMode = GREEDY):
        """Fill the buffers with a dummy batch that writes nowhere, warm up, capture."""
        step = self.step
        step.fill_dummy(bucket, q)
        fn = lambda: step.compute(bucket, q, kd, chained, mode)  # noqa: E731
        graph, outs = step.graphs.capture(fn)
        self.captures += 1
        return graph, outs

    def dummy_step(self, bucket: int, q: int):
        """The greedy graph a steady decode step of `bucket` rows of q tokens replays (its
        draft loop: StepDraftLengths.steady_kd), with a dummy batch staged for it, as a function
        that replays it; None where the fused step doesn't serve such steps or the graph is not
        captured. Start-up timing (runner/step_timing.py) replays it; nothing is in flight."""
        step = self.step
        if not step.accepts(None):
            return None
        entry = self.greedy.get((bucket, q, step.lengths.steady_kd(bucket, q), False))
        if entry is None:
            return None
        step.fill_dummy(bucket, q)
        graph = entry[0]
        return lambda: step.graphs.replay(graph, "step")
