"""The masked race kernel (kernels/masked_gumbel.py) on CUDA: the race over each row's top-k /
top-p / min-p nucleus without a sort, against race_tokens over apply_sampling_params' masks on
fresh inputs (tests/unit/masked_gumbel_cases.py), at the vocabularies the engine meets, and in a
CUDA graph with new values."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from outpace.kernels.masked_gumbel import masked_race_triton  # noqa: E402
from outpace.sample.gumbel import masked_race_tokens, race_tokens  # noqa: E402
from tests.unit.masked_gumbel_cases import assert_matches_reference, make_case  # noqa: E402


def cuda(case):
    return tuple(t.cuda() for t in case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 49152), (14, 49152), (37, 32000),
                                        (14, 4097), (6, 128256), (2, 152064), (5, 7)])
def test_masked_race_matches_reference(dtype, rows, vocab):
    for seed in range(2):
        case = make_case(rows, vocab, seed + rows + vocab, dtype)
        got = masked_race_triton(*cuda(case), pos_offset=1)
        assert got.dtype == torch.int64 and got.shape == (rows,)
        assert_matches_reference(got, case, pos_offset=1)
        assert torch.equal(masked_race_tokens(*cuda(case), pos_offset=1), got)


def test_unmasked_rows_draw_the_sampled_graphs_tokens():
    """Without masks the descent stops at the race's winner: the same token the argmax kernel's
    race draws (a sampled graph's), bit for bit, greedy rows included."""
    case = make_case(40, 49152, 5)
    logits, words, positions, temp, top_k, top_p, min_p = cuda(case)
    off = masked_race_triton(logits, words, positions, temp, torch.zeros_like(top_k),
                             torch.ones_like(top_p), torch.zeros_like(min_p))
    assert torch.equal(off, race_tokens(logits, words, positions, temperature=temp))


def test_masked_race_in_a_cuda_graph_sees_new_values():
    case = cuda(make_case(8, 49152, 1))
    logits = case[0]
    masked_race_triton(*case)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = masked_race_triton(*case)
    for seed in range(3):
        fresh = make_case(8, 49152, 100 + seed)
        logits.copy_(fresh[0])
        graph.replay()
        assert_matches_reference(out, (fresh[0],) + tuple(t.cpu() for t in case[1:]))


def test_nan_rows_give_ids_in_range():
    """A dropped row of a chained step may read never-written memory: the loop still ends."""
    case = list(cuda(make_case(6, 4097, 2)))
    case[0][0] = float("nan")
    case[0][1, 100] = float("nan")
    case[0][2, :] = float("inf")
    got = masked_race_triton(*case)
    assert ((got >= 0) & (got < 4097)).all()
