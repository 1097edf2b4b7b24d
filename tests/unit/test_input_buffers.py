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

