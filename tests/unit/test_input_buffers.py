"""InputBuffers.put_if_changed (runner/inputs.py): a chained step skips re-uploading block tables
that are already in the buffer, and never skips after anything else wrote the buffer."""

import numpy as np
import torch

from outpace.runner.inputs import InputBuffers, build_host_batch


def _buffers_counting_copies():
    buf = InputBuffers(max_tokens=32, max_seqs=4, max_blocks=8, device=torch.device("cpu"))
    staged = []
    inner = buf._stage
    buf._stage = lambda dst, src: (staged.append(dst.data_ptr()), inner(dst, src))[1]
    return buf, staged


def test_unchanged_tables_are_not_uploaded_again():
    buf, staged = _buffers_counting_copies()
    a = np.arange(16, dtype=np.int32).reshape(2, 8)
    buf.put_if_changed(buf.block_tables, a)
    buf.put_if_changed(buf.block_tables, a.copy())
    assert len(staged) == 1
    assert torch.equal(buf.block_tables[:2], torch.from_numpy(a))
    b = a.copy()
    b[1, 3] = 99  # a request got a new block
    buf.put_if_changed(buf.block_tables, b)
    assert len(staged) == 2 and int(buf.block_tables[1, 3]) == 99
    buf.put_if_changed(buf.block_tables, b[:1])  # another shape (batch size): uploaded
    assert len(staged) == 3


def test_other_writes_drop_the_memo():
    buf, staged = _buffers_counting_copies()
    a = np.full((1, 8), 7, dtype=np.int32)
    buf.put_if_changed(buf.block_tables, a)
    # A step loaded through load() (an eager or launched step) rewrote the tables.
    hb = build_host_batch([([1, 2, 3], 0, [5], [2])], block_size=16)
    buf.load(hb)
    buf.put_if_changed(buf.block_tables, a)
    assert torch.equal(buf.block_tables[:1], torch.from_numpy(a))
    # A direct write (a graph capture's dummy batch) followed by forget().
    buf.block_tables.zero_()
    buf.forget(buf.block_tables)
    n = len(staged)
    buf.put_if_changed(buf.block_tables, a)
    assert len(staged) == n + 1
    assert torch.equal(buf.block_tables[:1], torch.from_numpy(a))



def test_build_host_batch_equals_the_row_by_row_build():
    """The whole-batch build equals the row-by-row one (which small batches take) on random
    batches of prefill chunks, decode and verify rows, graph padding (tokens past num_real:
    slot -1, even past the table), empty offsets and tables, and the empty batch."""
    import random
    from outpace.runner.inputs import _build_row_by_row, _build_vectorized
    rnd = random.Random(0)
    for trial in range(300):
        bs = rnd.choice([1, 4, 16])
        rows = []
        for _ in range(rnd.randint(0, 9)):
            start = rnd.randint(0, 60)
            n = rnd.randint(1, 12)
            real = rnd.randint(1, n) if rnd.random() < 0.3 else n
            nblocks = -(-(start + real) // bs) + rnd.randint(0, 2)
            blocks = rnd.sample(range(1, 500), nblocks)
            toks = [rnd.randint(0, 99) for _ in range(n)]
            offsets = rnd.choice([[], [n - 1], list(range(max(0, n - 4), n))])
            rows.append((toks, start, blocks, offsets, real) if real < n or rnd.random() < 0.5
                        else (toks, start, blocks, offsets))
        if rows and rnd.random() < 0.1:  # a row whose real tokens need no block at all
            rows.append(([7], 0, [], [0], 0))
        want = _build_row_by_row(rows, bs)
        for got in (_build_vectorized(rows, bs), build_host_batch(rows, bs)):
            for name in ("input_ids", "positions", "slot_mapping", "query_start_loc",
                         "seq_lens", "block_tables", "logits_indices"):
                g, w = getattr(got, name), getattr(want, name)
                assert g.dtype == w.dtype and np.array_equal(g, w), (trial, name, rows)


def test_build_host_batch_rejects_a_position_past_the_table():
    import pytest
    row = ([1, 2], 15, [3], [1])  # position 16 needs a second block
    for rows in ([row], [row] * 9):  # both builds
        with pytest.raises(IndexError, match="block table"):
            build_host_batch(rows, block_size=16)


def test_request_token_slice_equals_slicing_all_token_ids():
    from outpace.types import Request, SamplingParams
    req = Request("r", [1, 2, 3, 4], SamplingParams(max_tokens=8))
    req.output_token_ids.extend([5, 6, 7])
    for start in range(8):
        for stop in range(start, 9):
            assert req.token_slice(start, stop) == req.all_token_ids[start:stop], (start, stop)
