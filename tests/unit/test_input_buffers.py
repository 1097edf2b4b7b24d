"""InputBuffers (attention/inputs.py): put_if_changed skips re-uploading block tables that are already
in the buffer, and never skips after anything else wrote the buffer; a load goes over in one copy
per segment, landing every array in its buffer's leading part; the host batch builders agree."""

import numpy as np
import torch

from outpace.attention.inputs import InputBuffers, build_host_batch


def _buffers_counting_copies():
    staged = []

    class CountingBuffers(InputBuffers):  # records each buffer it stages
        def _stage(self, pairs, *a):
            staged.extend(d.data_ptr() for d, _ in pairs)
            return super()._stage(pairs, *a)
    buf = CountingBuffers(max_tokens=32, max_seqs=4, max_blocks=8, device=torch.device("cpu"))
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



def _counting_segment_copies():
    """A Segment that records each copy's byte range, and that record."""
    from outpace.attention.inputs import Segment
    copies = []

    class CountingSegment(Segment):
        def _copy(self, start, end):
            copies.append((start, end))
            super()._copy(start, end)
    return CountingSegment, copies


def test_a_load_is_one_copy_and_lands_every_array():
    """A batch and extra buffers of another segment: one copy per segment; each array in its
    buffer's leading part (block tables: the first rows and columns), what lies past it
    untouched."""
    segment, copies = _counting_segment_copies()
    buf = InputBuffers(max_tokens=32, max_seqs=4, max_blocks=8, device=torch.device("cpu"),
                       segment=segment)
    nd, real = buf.add_buffers([((4,), torch.long), ((4,), torch.bool)])
    buf.block_tables.fill_(-5)  # written on the device outside put / load
    buf.forget(buf.block_tables)
    rows = [([3, 4, 5], 0, [7], [2]), ([9], 20, [2, 6], [0])]
    hb = build_host_batch(rows, block_size=16)
    ids, pos, li, meta = buf.load(hb, extra=((nd, np.array([0, 2])),
                                             (real, np.array([True, False, True]))))
    assert len(copies) == 2
    assert ids.tolist() == [3, 4, 5, 9] and pos.tolist() == [0, 1, 2, 20]
    assert li.tolist() == [2, 3] and meta.slot_mapping.tolist() == [112, 113, 114, 100]
    assert meta.query_start_loc.tolist() == [0, 3, 4] and meta.seq_lens.tolist() == [3, 21]
    assert meta.block_tables.tolist() == [[7, 0], [2, 6]]
    # past the last element written: untouched (between rows: the mirror's older values)
    assert buf.block_tables[1, 2:].eq(-5).all() and buf.block_tables[2:].eq(-5).all()
    assert nd.tolist() == [0, 2, 0, 0] and real.tolist() == [True, False, True, False]


def test_parts_far_apart_go_over_in_two_copies():
    from outpace.attention.inputs import Segment
    segment, copies = _counting_segment_copies()
    buf = InputBuffers(max_tokens=32, max_seqs=4, max_blocks=8, device=torch.device("cpu"),
                       segment=segment)
    far, near = buf.add_buffers([((2 * Segment.GAP,), torch.uint8), ((4,), torch.long)])
    buf.put_all([(far, np.ones(3, np.uint8)), (near, np.array([7, 8]))])
    assert len(copies) == 2
    assert far[:4].tolist() == [1, 1, 1, 0] and near.tolist() == [7, 8, 0, 0]
    copies.clear()
    buf.put_all([(near, np.array([1])), (far, np.ones(0, np.uint8))])  # nothing to copy there
    assert len(copies) == 1 and near.tolist() == [1, 8, 0, 0]


def test_only_whole_staged_buffers_are_accepted():
    buf = InputBuffers(max_tokens=32, max_seqs=4, max_blocks=8, device=torch.device("cpu"))
    for dst in (torch.zeros(4, dtype=torch.long), buf.input_ids[:8]):
        try:
            buf.put(dst, np.arange(2))
        except ValueError as e:
            assert "whole buffers" in str(e)
        else:
            raise AssertionError("staged a tensor that is not a buffer of add_buffers")


def test_build_host_batch_equals_the_row_by_row_build():
    """The whole-batch build equals the row-by-row one (which small batches take) on random
    batches of prefill chunks, decode and verify rows, graph padding (tokens past num_real:
    slot -1, even past the table), empty offsets and tables, and the empty batch."""
    import random
    from outpace.attention.inputs import _build_row_by_row, _build_vectorized
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
