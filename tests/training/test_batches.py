"""Training sequences: the answer mask, and answers cut once they loop."""

from __future__ import annotations

from outpace.training.batches import LOOP_SPAN, loop_start, sequences_from_records


def _loop(prefix: int, period: int, repeats: int) -> list:
    body = list(range(1000, 1000 + period))
    return list(range(prefix)) + body * repeats


def test_loop_start_is_the_first_repeated_span():
    assert loop_start(list(range(200))) is None
    assert loop_start(list(range(LOOP_SPAN))) is None
    # a period-40 loop after 10 free tokens: the span at 10 + 40 repeats the one at 10
    assert loop_start(_loop(10, 40, 5)) == 50
    # a period shorter than the span still loops from its first repeat
    assert loop_start([7] * 40) == 1
    # a repeat shorter than the span is not a loop
    assert loop_start(list(range(20)) + list(range(20)) + list(range(100, 150))) is None


def test_sequences_keep_loop_tokens_past_the_loop_and_mask_the_answer():
    answer = _loop(10, 40, 6)
    rec = [{"prompt_ids": [1, 2, 3], "answer_ids": answer}]
    whole = sequences_from_records(rec, 2048)[0]
    assert whole.ids == tuple([1, 2, 3] + answer) and whole.answer_start == 3
    cut = sequences_from_records(rec, 2048, loop_tokens=16)[0]
    assert cut.ids == tuple([1, 2, 3] + answer[:50 + 16])
    # an answer without a loop is untouched; max_len still applies after the cut
    plain = [{"prompt_ids": [1], "answer_ids": list(range(300))}]
    assert len(sequences_from_records(plain, 2048, loop_tokens=0)[0].ids) == 301
    assert len(sequences_from_records(rec, 20, loop_tokens=16)[0].ids) == 20
    # nothing left to learn (fewer than 2 answer tokens): dropped
    assert sequences_from_records(rec, 4, loop_tokens=16) == []
