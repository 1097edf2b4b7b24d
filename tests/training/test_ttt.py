"""Training-time test against the inference heads run step by step over a paged KV pool.

The oracle is the engine's own draft computation (models/eagle3.py, models/mtp.py through the
TorchRefBackend): for each anchor p, a fresh KV plane gets the first pass over positions 0..p,
then the chain's steps one row at a time at p + 1, p + 2, ... (head_proposer.py's draft loop);
MTP's depths mode runs each module over the whole window in its own plane (mtp_window.py).
TTT's batched, masked unroll must give the same hidden states at every step and row.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from outpace.attention.base import ForwardContext
from outpace.models.eagle3 import Eagle3Head
from outpace.models.mtp import MTPHead
from outpace.training.heads import fill_head_
from outpace.training.init_draft import eagle3_config_for, random_head_tensors
from outpace.training.ttt import CHAIN, DEPTHS, Eagle3Unroll, MTPUnroll, shift, unroll
from tests.models.helpers import PagedRunner
from tests.speculative.spec_helpers import tiny_config

T, STEPS = 12, 4


def _randomized(head, seed):
    """Weights large enough that attention is far from uniform (a wrong mask shows)."""
    g = torch.Generator().manual_seed(seed)
    tensors = random_head_tensors(head, seed)
    for name, t in tensors.items():
        if not t.is_floating_point():
            continue
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.2 * torch.randn(t.shape, generator=g)
        else:
            tensors[name] = 0.25 * torch.randn(t.shape, generator=g)
    fill_head_(head, tensors)
    return head.eval()


def _runner(cfg, slots):
    shim = SimpleNamespace(config=cfg, dtype=torch.float32)
    return PagedRunner(shim, num_seqs=1, max_len=64, num_slots=slots)


def _run_head(call, runner, hidden, ids, n):
    meta, pos = runner.meta({0: n})
    return call(hidden, ids, pos, ForwardContext(runner.backend, meta))


@pytest.fixture
def setup():
    cfg = tiny_config()
    g = torch.Generator().manual_seed(3)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    return cfg, g, embed, ids


def test_eagle3_ttt_matches_step_by_step_drafting(setup):
    cfg, g, embed, ids = setup
    L = cfg.num_hidden_layers
    head = _randomized(Eagle3Head(eagle3_config_for(cfg), L), 1)
    aux = [torch.randn(T, cfg.hidden_size, generator=g) for _ in range(3)]
    model = Eagle3Unroll(head, embed)
    with torch.no_grad():
        first = model.first_hidden(torch.cat(aux, -1)[None])
        ttt = [h[0] for _, h in unroll(model, first, ids[None], STEPS)]

    def call(hidden, tok, pos, ctx):
        return head(hidden, tok, pos, ctx, embed_fn=lambda x: F.embedding(x, embed))

    nxt = shift(ids[None], 1)[0]
    checked = 0
    with torch.no_grad():
        for p in range(T - 1):
            r = _runner(cfg, L + 1)
            out = _run_head(call, r, head.fuse([a[:p + 1] for a in aux]), nxt[:p + 1], p + 1)
            h = out[p:p + 1]
            torch.testing.assert_close(h[0], ttt[0][p], rtol=1e-3, atol=1e-3)
            for j in range(1, STEPS):
                if p + 1 + j >= T:
                    break
                h = _run_head(call, r, h, ids[p + 1 + j:p + 2 + j], 1)
                torch.testing.assert_close(h[0], ttt[j][p], rtol=1e-3, atol=1e-3)
                checked += 1
    assert checked > 20


def test_mtp_chain_ttt_matches_step_by_step_drafting(setup):
    cfg, g, embed, ids = setup
    L = cfg.num_hidden_layers
    head = _randomized(MTPHead(cfg, 1, L), 2)
    target = SimpleNamespace(embed_weight=embed)
    hidden0 = torch.randn(T, cfg.hidden_size, generator=g)
    model = MTPUnroll(head, target, CHAIN)
    with torch.no_grad():
        ttt = [h[0] for _, h in unroll(model, hidden0[None], ids[None], STEPS)]

    def call(hidden, tok, pos, ctx):
        return head(0, hidden, tok, pos, ctx, embed_fn=lambda x: F.embedding(x, embed))

    nxt = shift(ids[None], 1)[0]
    with torch.no_grad():
        for p in range(T - STEPS):
            r = _runner(cfg, L + 1)
            h = _run_head(call, r, hidden0[:p + 1], nxt[:p + 1], p + 1)[p:p + 1]
            torch.testing.assert_close(h[0], ttt[0][p], rtol=1e-3, atol=1e-3)
            for j in range(1, STEPS):
                h = _run_head(call, r, h, ids[p + 1 + j:p + 2 + j], 1)
                torch.testing.assert_close(h[0], ttt[j][p], rtol=1e-3, atol=1e-3)


def test_mtp_depths_ttt_matches_each_module_over_the_window(setup):
    cfg, g, embed, ids = setup
    L, D = cfg.num_hidden_layers, 3
    head = _randomized(MTPHead(cfg, D, L), 4)
    target = SimpleNamespace(embed_weight=embed)
    hidden0 = torch.randn(T, cfg.hidden_size, generator=g)
    model = MTPUnroll(head, target, DEPTHS)
    with torch.no_grad():
        ttt = [h[0] for _, h in unroll(model, hidden0[None], ids[None], D)]
        r = _runner(cfg, L + D)
        h = hidden0
        for d in range(D):
            r.lens = [0]  # module d's own plane, over the same positions
            tok = shift(ids[None], 1 + d)[0]
            h = _run_head(lambda hid, t, pos, ctx: head(d, hid, t, pos, ctx, embed_fn=lambda x:
                                                        F.embedding(x, embed)), r, h, tok, T)
            torch.testing.assert_close(h, ttt[d], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("mode", [CHAIN, DEPTHS])
def test_mtp_logits_read_each_modules_own_norm(setup, mode):
    """A head with shared_head.norm: step i's logits go through the norm the engine reads that
    step's drafts with (MTPHead.compute_logits at module i in depths mode, module 0 in chain
    mode), not the target's final norm."""
    cfg, g, embed, _ = setup
    L, D = cfg.num_hidden_layers, 3
    head = _randomized(MTPHead(cfg, D, L, shared_head_norm=True), 5)
    norm = torch.nn.Module()
    norm.weight, norm.eps = torch.rand(cfg.hidden_size, generator=g) * 3, cfg.rms_norm_eps
    lm = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    target = SimpleNamespace(embed_weight=embed, norm=norm, lm_head_weight=lm,
                             compute_logits=lambda x: x @ lm.T)
    model = MTPUnroll(head, target, mode)
    hidden = torch.randn(5, cfg.hidden_size, generator=g)
    for i in range(D):
        got = model.logits(hidden, i)
        want = head.compute_logits(hidden, target, i if mode == DEPTHS else 0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        through_target = (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) +
                                               cfg.rms_norm_eps) * norm.weight) @ lm.T
        assert not torch.allclose(got, through_target, atol=1e-2)


def test_chain_mask_is_causal_then_diagonal():
    """The chain attention equals a dense softmax over the keys the draft loop leaves visible."""
    from outpace.training.ttt import ttt_attention
    g = torch.Generator().manual_seed(0)
    b, h, t, d, steps = 2, 3, 7, 8, 4
    keys = [torch.randn(b, h, t, d, generator=g) for _ in range(steps)]
    values = [torch.randn(b, h, t, d, generator=g) for _ in range(steps)]
    q = torch.randn(b, h, t, d, generator=g)
    for i in range(steps):
        dk = torch.stack(keys[1:i + 1], dim=-2) if i else None
        dv = torch.stack(values[1:i + 1], dim=-2) if i else None
        got = ttt_attention(q, keys[0], values[0], dk, dv, CHAIN)
        for p in range(t):
            ks = torch.cat([keys[0][:, :, :p + 1]] + [kk[:, :, p:p + 1] for kk in keys[1:i + 1]],
                           dim=2)
            vs = torch.cat([values[0][:, :, :p + 1]] +
                           [vv[:, :, p:p + 1] for vv in values[1:i + 1]], dim=2)
            w = torch.softmax((q[:, :, p:p + 1] @ ks.transpose(-1, -2)) * d ** -0.5, dim=-1)
            torch.testing.assert_close(got[:, :, p:p + 1], w @ vs, rtol=1e-5, atol=1e-5)
