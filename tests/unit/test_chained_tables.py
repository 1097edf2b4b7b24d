"""FusedStep's block tables for chained steps (ChainedTables): updated in the rows that changed,
always equal to the table built from scratch."""

from __future__ import annotations

import random

import numpy as np

from outpace.runner.chained_tables import ChainedTables


def _scratch(bucket, width, tables):
    bt = np.zeros((bucket, width), np.int32)
    for i, ids in enumerate(tables):
        bt[i, :len(ids)] = ids
    return bt


def test_chained_tables_equal_a_fresh_build():
    rng = random.Random(0)
    width, bucket = 12, 8
    ct = ChainedTables(width)
    next_block = iter(range(1, 10_000))
    rows = [f"r{i}" for i in range(6)]
    tables = {r: [next(next_block)] for r in rows}
    for step in range(200):
        if step % 37 == 36:  # a new chain: other requests, another order
            rows = rng.sample(rows, len(rows))[:5] + [f"n{step}"]
            tables = {r: tables.get(r, [next(next_block)]) for r in rows}
        for r in rows:
            if tables[r] and len(tables[r]) < width and rng.random() < 0.2:
                tables[r].append(next(next_block))  # a table only grows while running
            elif tables[r] and rng.random() < 0.02:
                tables[r] = []  # finished: its row is emptied
        got = ct.update(rows, bucket, [list(tables[r]) for r in rows])
        assert np.array_equal(got, _scratch(bucket, width, [tables[r] for r in rows])), step


def test_a_changed_bucket_rebuilds():
    ct = ChainedTables(4)
    a = ct.update(["x", "y"], 2, [[1, 2], [3]]).copy()
    b = ct.update(["x", "y"], 4, [[1, 2], [3]])
    assert b.shape == (4, 4) and np.array_equal(b[:2], a) and not b[2:].any()
