"""The draft heads' input kernel (outpace/kernels/embed_norm_cat.py) on CUDA: bit for bit the
composition it replaces (gather, cast, norm.py's kernel twice, cat), close to the torch
reference, PDL-chained in a CUDA graph; and the heads' fused path equal to their composition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from outpace.kernels.embed_norm_cat import (embed_norm_cat, embed_norm_cat_ref,  # noqa: E402
                                        embed_norm_cat_triton)
from outpace.kernels.norm import rms_norm_ref, rms_norm_triton  # noqa: E402
from outpace.kernels.options import use_kernel_options  # noqa: E402
from outpace.runner_config import KernelOptions  # noqa: E402

DEV = "cuda"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
# (activation dtype, table dtype): weight_dtype stores the table narrower than the activations
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float16, torch.float16), (torch.float32, torch.bfloat16),
          (torch.float32, torch.float16), (torch.bfloat16, torch.float32)]


def _case(t, h, dtype, table_dtype, seed, vocab=5000):
    g = torch.Generator(device=DEV).manual_seed(seed)
    table = (torch.randn(vocab, h, device=DEV, generator=g) * 2).to(table_dtype)
    ids = torch.randint(0, vocab, (t,), device=DEV, generator=g)
    ids[-1] = vocab - 1  # the last row of the table too
    ew = (1 + 0.2 * torch.randn(h, device=DEV, generator=g)).to(dtype)
    hw = (1 + 0.2 * torch.randn(h, device=DEV, generator=g)).to(dtype)
    hidden = (torch.randn(t, h + 8, device=DEV, generator=g) * 3).to(dtype)[:, 4:4 + h]
    return ids, table, ew, hidden, hw


def _composition(ids, table, ew, hidden, hw, eps):
    """What the heads ran on CUDA before: F.embedding, .to, rms_norm_triton twice, cat."""
    emb = F.embedding(ids, table).to(hidden.dtype)
    return torch.cat([rms_norm_triton(emb, ew, eps), rms_norm_triton(hidden, hw, eps)], -1)


@pytest.mark.parametrize("dtype,table_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", [1, 3, 7, 16])
@pytest.mark.parametrize("h", [64, 576, 4096])
def test_embed_norm_cat_matches(dtype, table_dtype, t, h):
    ids, table, ew, hidden, hw = _case(t, h, dtype, table_dtype, seed=t * h)
    got = embed_norm_cat(ids, table, ew, hidden, hw, 1e-5)
    assert got.dtype == dtype and got.shape == (t, 2 * h)
    comp = _composition(ids, table, ew, hidden, hw, 1e-5)
    if table_dtype == dtype:
        assert torch.equal(got, comp)
    else:  # the narrower row's load sets the kernel's register layout (for both halves):
        # the statistics are summed in another order (run 14: fp32 results an ulp or so
        # apart at H = 576 and 4096)
        torch.testing.assert_close(got, comp, **TOL[torch.float32])
    torch.testing.assert_close(got, embed_norm_cat_ref(ids, table, ew, hidden, hw, 1e-5),
                               **TOL[dtype])
    # the second half is hidden's norm, usable as a view (EAGLE-3's norm_before_residual)
    torch.testing.assert_close(got[:, h:], rms_norm_triton(hidden, hw, 1e-5),
                               **(TOL[torch.float32] if table_dtype != dtype
                                  else dict(atol=0, rtol=0)))
    assert not torch.equal(got[:, :h], rms_norm_triton(F.embedding(ids, table).to(dtype), hw,
                                                       1e-5))


def test_embed_norm_cat_int32_ids_and_dispatch():
    ids, table, ew, hidden, hw = _case(5, 576, torch.bfloat16, torch.bfloat16, seed=3)
    got = embed_norm_cat_triton(ids.int(), table, ew, hidden, hw, 1e-6)
    assert torch.equal(got, _composition(ids, table, ew, hidden, hw, 1e-6))
    # mixed dtypes the kernel does not take: the reference (the composition's promotions)
    fp32_w = ew.float()
    want = embed_norm_cat_ref(ids, table, fp32_w, hidden, hw, 1e-6)
    assert torch.equal(embed_norm_cat(ids, table, fp32_w, hidden, hw, 1e-6), want)
    assert want.dtype == torch.float32
    assert embed_norm_cat(ids[:0], table, ew, hidden[:0], hw, 1e-6).shape == (0, 2 * 576)


def test_embed_norm_cat_in_a_pdl_graph_sees_new_inputs():
    """Behind a PDL norm kernel that writes its hidden input, replayed with new ids and hidden:
    the kernel gathers and reads only after the wait (else it would race and differ)."""
    ids, table, ew, hidden, hw = _case(4, 576, torch.bfloat16, torch.bfloat16, seed=11)
    x, nw = hidden.contiguous(), hw
    static_ids, static_x = ids.clone(), x.clone()

    def chain(i, xx):
        # a producer of both inputs: ids from a torch kernel, hidden from a PDL norm kernel
        h = rms_norm_triton(rms_norm_triton(xx, nw, 1e-6), nw, 1e-6)
        return embed_norm_cat(i + 0, table, ew, h, hw, 1e-6)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(static_ids, static_x)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static_ids, static_x)
    for seed in range(3):
        g = torch.Generator(device=DEV).manual_seed(50 + seed)
        new_ids = torch.randint(0, table.shape[0], ids.shape, device=DEV, generator=g)
        new_x = torch.randn(x.shape, device=DEV, generator=g).to(x.dtype)
        static_ids.copy_(new_ids)
        static_x.copy_(new_x)
        graph.replay()
        with use_kernel_options(KernelOptions(pdl=False)):
            want = chain(new_ids, new_x)
        assert torch.equal(out, want)
        h = rms_norm_ref(rms_norm_ref(new_x, nw, 1e-6), nw, 1e-6)
        torch.testing.assert_close(out, embed_norm_cat_ref(new_ids, table, ew, h, hw, 1e-6),
                                   **TOL[torch.bfloat16])


# ---- the heads: the fused path gives their composition's values -------------------------------

def _randomize_(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_((1 + 0.2 * r if n.endswith("norm.weight") or n.endswith("enorm.weight")
                     or n.endswith("hnorm.weight") else 0.2 * r).to(p.dtype))


def _ctx(t, hkv, d, num_slots, dtype):
    from outpace.attention.base import AttentionMetadata, ForwardContext
    from outpace.attention.triton_paged import TritonPagedBackend
    bs, blocks = 16, 8
    kv = torch.zeros(num_slots, 2, blocks, bs, hkv, d, device=DEV, dtype=dtype)
    backend = TritonPagedBackend(kv, 4, hkv, d, d ** -0.5)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(bs, bs + t, device=DEV),
        query_start_loc=torch.tensor([0, t], device=DEV, dtype=torch.int32),
        seq_lens=torch.tensor([t], device=DEV, dtype=torch.int32),
        block_tables=torch.tensor([[1, 2]], device=DEV, dtype=torch.int32),
        query_start_loc_host=[0, t], seq_lens_host=[t], max_query_len=t, max_seq_len=t)
    return ForwardContext(backend, meta), kv


def _cfg():
    from outpace.model_config import ModelConfig
    return ModelConfig(architecture="llama", vocab_size=300, hidden_size=64,
                       intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position_embeddings=64)


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("dtype,table_dtype", [(torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)], ids=str)
def test_eagle3_head_fused_input_equals_composition(norm_before_residual, dtype, table_dtype):
    from outpace.models.eagle3 import Eagle3Config, Eagle3Head
    cfg = _cfg()
    ecfg = Eagle3Config(layer=cfg, draft_vocab_size=50, target_num_hidden_layers=4,
                        norm_before_residual=norm_before_residual)
    head = Eagle3Head(ecfg, layer_slot=4, dtype=dtype, device=DEV)
    _randomize_(head, 1)
    table = torch.randn(cfg.vocab_size, 64, device=DEV).to(table_dtype)
    t = 5
    hidden = torch.randn(t, 64, device=DEV).to(dtype)
    ids = torch.randint(0, cfg.vocab_size, (t,), device=DEV)
    pos = torch.arange(t, device=DEV)
    outs, caches = [], []
    for kw in ({}, {"embed_weight": table}):
        ctx, kv = _ctx(t, 2, 16, 5, dtype)
        with torch.no_grad():
            outs.append(head(hidden, ids, pos, ctx,
                             embed_fn=lambda i: F.embedding(i, table).to(dtype), **kw))
        caches.append(kv)
    assert torch.equal(outs[1], outs[0]) and torch.equal(caches[1], caches[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_mtp_head_fused_input_equals_composition(dtype):
    from outpace.models.mtp import MTPHead
    cfg = _cfg()
    head = MTPHead(cfg, num_modules=1, first_layer_slot=4, dtype=dtype, device=DEV)
    _randomize_(head, 2)
    table = torch.randn(cfg.vocab_size, 64, device=DEV).to(dtype)
    t = 3
    hidden = torch.randn(t, 64, device=DEV).to(dtype)
    ids = torch.randint(0, cfg.vocab_size, (t,), device=DEV)
    pos = torch.arange(t, device=DEV)
    outs = []
    for kw in ({}, {"embed_weight": table}):
        ctx, _ = _ctx(t, 2, 16, 5, dtype)
        with torch.no_grad():
            outs.append(head(0, hidden, ids, pos, ctx, lambda i: F.embedding(i, table), **kw))
    assert torch.equal(outs[1], outs[0])


def test_eagle3_greedy_target_ids_equal_d2t_mapping():
    from outpace.models.eagle3 import Eagle3Config, Eagle3Head
    cfg = _cfg()
    head = Eagle3Head(Eagle3Config(layer=cfg, draft_vocab_size=50, target_num_hidden_layers=4),
                      layer_slot=4, dtype=torch.bfloat16, device=DEV)
    _randomize_(head, 3)
    sub = torch.randperm(cfg.vocab_size, device=DEV)[:50].sort().values
    head.d2t.copy_(sub - torch.arange(50, device=DEV))
    hidden = torch.randn(7, 64, device=DEV).to(torch.bfloat16)
    got = head.greedy_target_ids(hidden)
    assert torch.equal(got, head.draft_to_target(head.greedy_draft_ids(hidden)))
    assert torch.equal(got, sub[head.compute_draft_logits(hidden).argmax(-1)])
