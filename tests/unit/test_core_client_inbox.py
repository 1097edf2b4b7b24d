"""EngineCoreClient's reader hands the core's messages to the tokenizer thread through an inbox
and at most one queued drain job (_read_loop, _drain_inbox): no message may be lost or
reordered, however the reader and the drains interleave, and the pipe's end (_on_exit) comes
after the last message."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import pytest

from outpace.engine.core_client import EngineCoreClient
from outpace.engine.output_processor import CoreOutput


class _Conn:
    def __init__(self, msgs, rng):
        self.msgs, self.rng = list(msgs), rng

    def recv(self):
        if not self.msgs:
            raise EOFError
        if self.rng.random() < 0.05:
            time.sleep(self.rng.random() * 1e-3)
        return self.msgs.pop(0)


def _client(msgs, seed):
    rng = random.Random(seed)
    c = EngineCoreClient.__new__(EngineCoreClient)
    c._init_state(None)
    c._conn = _Conn(msgs, rng)
    c._jobs = concurrent.futures.ThreadPoolExecutor(1)
    seen, slow = [], random.Random(seed + 1)

    def on_message(msg):
        if slow.random() < 0.1:
            time.sleep(slow.random() * 2e-3)  # the tokenizer thread falls behind
        seen.append(msg)

    c._on_message = on_message
    c._on_exit = lambda: seen.append(("exit",))
    return c, seen


@pytest.mark.parametrize("seed", range(5))
def test_every_message_is_drained_in_order_and_the_exit_comes_last(seed):
    msgs = [("note", i) for i in range(2000)]  # not step messages: none are merged
    c, seen = _client(msgs, seed)
    t = threading.Thread(target=c._read_loop)
    t.start()
    t.join(30)
    c._jobs.shutdown(wait=True)
    assert seen == msgs + [("exit",)]
    assert not c._inbox and not c._drain_queued


@pytest.mark.parametrize("seed", range(5))
def test_step_messages_lose_no_token_however_they_are_drained(seed):
    rng = random.Random(seed)
    msgs, expect = [], {}
    for step in range(500):
        outs = []
        for rid in ("a", "b", "c"):
            if rng.random() < 0.7:
                ids = [rng.randrange(100) for _ in range(rng.choice([1, 1, 2]))]
                expect.setdefault(rid, []).extend(ids)
                outs.append(CoreOutput(rid, ids, None, None, None, 3, 0, None))
        msgs.append(("out", [], outs, [], {"step": step}))
    c, seen = _client(msgs, seed)
    t = threading.Thread(target=c._read_loop)
    t.start()
    t.join(30)
    c._jobs.shutdown(wait=True)
    assert seen[-1] == ("exit",)
    got = {}
    for _, _, outs, _, stats in seen[:-1]:
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert got == expect
    assert seen[-2][4] == {"step": 499}  # the last stats win
