"""The block tables of consecutive chained fused steps (runner/fused_step.py), kept on the host
between them."""

from __future__ import annotations

import numpy as np


class ChainedTables:
    """The [bucket, W] block tables of consecutive chained steps, kept between them and
    rewritten only in the rows whose table changed. While a request runs its table only grows
    (KVCacheManager appends blocks), so a row's (length, last block) tells whether it changed;
    a finished request's table is empty. At batch 128 rebuilding all rows every step was a
    Python loop of 128 numpy row writes on the host's critical path."""

    def __init__(self, width: int):
        self.width = width
        self.rows: list = []  # request ids, in device row order, of the tables held
        self.sig: list = []  # per row: (length, last block id) of the table held
        self.table = np.zeros((0, width), np.int32)

    def update(self, rows: list, bucket: int, block_tables: list) -> np.ndarray:
        sig = [(len(ids), ids[-1] if ids else -1) for ids in block_tables]
        if rows != self.rows or self.table.shape[0] != bucket:
            self.rows, self.sig = list(rows), [None] * len(sig)
            self.table = np.zeros((bucket, self.width), np.int32)
        for i, (now, ids) in enumerate(zip(sig, block_tables)):
            if now != self.sig[i]:
                self.table[i] = 0
                self.table[i, :len(ids)] = ids
        self.sig = sig
        return self.table
