"""MTP modules with their own final norm (`layers.{d}.shared_head.norm.weight`, DeepSeek's
layout): every draft the engine proposes, in eagle mode (module 0 applied k times) and in depths
mode (module d at depth d), equals the argmax of a dense reference that applies each module's
own norm before the target's LM head, and not the one through the target's final norm; the
speculative output stays the target's greedy output."""

from __future__ import annotations

import pytest
import torch

from outpace import SamplingParams
from outpace.models.draft_loader import mtp_config_dict, save_draft_head
from outpace.models.mtp import MTPHead
from outpace.training.init_draft import random_head_tensors
from tests.engine_helpers import make_engine
from tests.speculative.spec_helpers import (EXACT_DRAFTS, TINY_BLOCK, dense_ctx, dense_target,
                                            repetitive_prompts, run_waves)

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
MODULES = 3
GAP = 1e-3  # a reference draft whose top-1/top-2 logit gap is below this is not compared


@pytest.fixture(scope="module")
def shared_norm_head(tiny_loaded, tmp_path_factory):
    """A 3-module head whose modules have far-from-one final norms (and, as DeepSeek's
    checkpoints, a copy of the target's LM head as shared_head.head)."""
    model, cfg, _ = tiny_loaded
    head = MTPHead(cfg, MODULES, cfg.num_hidden_layers, device="meta", shared_head_norm=True)
    tensors = random_head_tensors(head, 5)
    g = torch.Generator().manual_seed(6)
    for d in range(MODULES):
        tensors[f"layers.{d}.shared_head.norm.weight"] = torch.rand(cfg.hidden_size,
                                                                    generator=g) * 3
        tensors[f"layers.{d}.shared_head.head.weight"] = model.lm_head_weight.detach().clone()
    return save_draft_head(mtp_config_dict(cfg, MODULES), tensors,
                           tmp_path_factory.mktemp("mtp_shared_norm"))


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def argmax_with_gap(h, norm_w, eps, lm_head):
    """-> (token, top-1/top-2 gap) of lm_head(rms(h) * norm_w) for one row h [1, H]."""
    top = (rms(h, norm_w, eps) @ lm_head.T)[0].topk(2)
    return int(top.indices[0]), float(top.values[0] - top.values[1])


@torch.inference_mode()
def dense_drafts(head, model, cfg, ids: list, k: int, mode: str, norms: list):
    """The k drafts for committed `ids`, recomputed in fresh pools (exact entries only), each
    module's output read through norms[d] -> (drafts, the smallest top-1/top-2 gap)."""
    L, f, lm, eps = cfg.num_hidden_layers, len(ids), model.lm_head_weight, cfg.rms_norm_eps
    hidden, _, _ = dense_target(model, cfg, ids)
    m = f - 1  # rows 0..f-2: the positions whose next token is committed
    kv = torch.zeros(L + MODULES, 2, (f + k) // TINY_BLOCK + 2, TINY_BLOCK,
                     cfg.num_key_value_heads, cfg.head_dim)
    embed = dict(embed_fn=model.embed_tokens)
    drafts, gaps = [], []
    if mode == "eagle":  # module 0: first pass, then one row a draft at f-2+j
        h = head(0, hidden[:m], torch.tensor(ids[1:]), torch.arange(m), dense_ctx(kv, m, cfg),
                 **embed)[m - 1:m]
        for j in range(k):
            if j:
                ctx = dense_ctx(kv, m + j, cfg)
                meta = ctx.meta
                meta.slot_mapping = meta.slot_mapping[-1:]
                meta.query_start_loc = torch.tensor([0, 1], dtype=torch.int32)
                meta.query_start_loc_host = [0, 1]
                meta.max_query_len = 1
                h = head(0, h, torch.tensor(drafts[-1:]), torch.tensor([m - 1 + j]), ctx, **embed)
            tok, gap = argmax_with_gap(h, norms[0], eps, lm)
            drafts.append(tok)
            gaps.append(gap)
    else:  # depths: module d over positions 0..f-2 with the tokens d+1 ahead
        h = hidden[:m]
        for d in range(k):
            seq = ids + drafts
            h = head(d, h, torch.tensor(seq[d + 1:d + 1 + m]), torch.arange(m),
                     dense_ctx(kv, m, cfg), **embed)
            tok, gap = argmax_with_gap(h[m - 1:m], norms[d], eps, lm)
            drafts.append(tok)
            gaps.append(gap)
    return drafts, min(gaps)


@pytest.mark.parametrize("mode,k", [("eagle", 3), ("depths", 3), ("depths", 2)])
def test_drafts_read_each_modules_own_norm(tiny_loaded, shared_norm_head, mode, k):
    model, cfg, _ = tiny_loaded
    prompts = repetitive_prompts(3, 11)
    want = run_waves(tiny_loaded, [prompts], GREEDY, block_size=TINY_BLOCK).outputs
    spec = {"method": "mtp", "model": str(shared_norm_head), "num_speculative_tokens": k,
            "mtp_mode": mode, **EXACT_DRAFTS}
    eng = make_engine(tiny_loaded, speculative_config=spec, block_size=TINY_BLOCK)
    head = eng.runner.proposer.head
    assert head.has_shared_head_norm
    own = [head.layers[d].shared_head_norm.weight for d in range(MODULES)]
    target_norm = [model.norm.weight] * MODULES
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    compared = differs = 0
    done, bad = {}, []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        for req in eng.scheduler.running:
            got = req.spec_token_ids
            if not got:
                continue
            ids = req.all_token_ids
            ref, gap = dense_drafts(head, model, cfg, ids, len(got), mode, own)
            if gap < GAP:
                continue
            if got != ref:
                bad.append(f"{req.request_id} at f={len(ids)}: drafts {got}, want {ref}")
            compared += 1
            differs += dense_drafts(head, model, cfg, ids, len(got), mode, target_norm)[0] != ref
    assert not bad, bad[:3]
    assert compared >= 10
    assert differs >= compared // 2, "the module norm and the target's give the same drafts"
    assert [done[f"r{i}"] for i in range(len(prompts))] == want  # lossless


def test_fused_step_reads_the_modules_norm(tiny_loaded, shared_norm_head):
    """The fused step's device draft loop (its gather + norm before the LM head, on CPU through
    the graph stand-in) proposes the eager path's drafts, which read module 0's own norm
    (above)."""
    from tests.speculative.test_fused_step import FEW_SEQS, record_drafts
    spec = {"method": "mtp", "model": str(shared_norm_head), "num_speculative_tokens": 3,
            "mtp_mode": "eagle", **EXACT_DRAFTS}
    prompts = [repetitive_prompts(4, 13)]
    want, got = [], []
    eager = run_waves(tiny_loaded, prompts, GREEDY, speculative_config=spec,
                      on_engine=lambda e: record_drafts(e, want), block_size=TINY_BLOCK,
                      **FEW_SEQS)
    fused = run_waves(tiny_loaded, prompts, GREEDY, speculative_config=spec, overlap=False,
                      on_engine=lambda e: record_drafts(e, got, graphs_k=3),
                      block_size=TINY_BLOCK, **FEW_SEQS)
    assert fused.engine.runner.fused.replays > 10
    assert sum(len(d) for step in got for d in step.values()) > 30
    assert got == want and fused.outputs == eager.outputs
