"""The draft vocabulary map, and exported heads: the public EAGLE-3 layout, export -> load."""

from __future__ import annotations

import json

import pytest
import torch

from outpace.attention.base import ForwardContext
from outpace.models.cpu_fast_paths import add_weight_copies_
from outpace.models.draft_loader import export_weights, load_draft_head
from outpace.training.draft_vocab import choose_draft_vocab, count_tokens, coverage, draft_ids_of
from outpace.training.heads import (export_head, head_from_export, new_eagle3_head,
                                    new_mtp_head)
from tests.models.helpers import PagedRunner


def test_draft_vocab_takes_the_most_frequent_ids_and_maps_consistently():
    counts = count_tokens([[5, 5, 5, 9, 9, 2], [7, 9, 2, 2, 5, 1]], 12)
    assert counts.tolist() == [0, 1, 3, 0, 0, 4, 0, 1, 0, 3, 0, 0]
    d2t, t2d = choose_draft_vocab(counts, 4)
    ids = draft_ids_of(d2t)
    # 5 (4), 2 and 9 (3 each), then the tie at 1 between ids 1 and 7: the lower id; draft ids
    # run in target-id order
    assert ids.tolist() == [1, 2, 5, 9]
    for i in range(d2t.numel()):
        assert bool(t2d[i + d2t[i]])
    assert int(t2d.sum()) == d2t.numel()
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert coverage(counts, t2d) == pytest.approx(11 / 12)
    with pytest.raises(ValueError, match="1..12"):
        choose_draft_vocab(counts, 13)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        count_tokens([[12]], 12)


PUBLIC_EAGLE3 = {  # name -> (shape in terms of H, Hq*D, Hkv*D, I, dv, V; dtype)
    "fc.weight": ("H", "3H"), "midlayer.hidden_norm.weight": ("H",),
    "midlayer.input_layernorm.weight": ("H",), "midlayer.post_attention_layernorm.weight": ("H",),
    "midlayer.self_attn.q_proj.weight": ("Q", "2H"), "midlayer.self_attn.k_proj.weight": ("KV", "2H"),
    "midlayer.self_attn.v_proj.weight": ("KV", "2H"), "midlayer.self_attn.o_proj.weight": ("H", "Q"),
    "midlayer.mlp.gate_proj.weight": ("I", "H"), "midlayer.mlp.up_proj.weight": ("I", "H"),
    "midlayer.mlp.down_proj.weight": ("H", "I"), "norm.weight": ("H",),
    "lm_head.weight": ("DV", "H"), "d2t": ("DV",), "t2d": ("V",)}


def test_exported_eagle3_head_has_the_public_names_dtypes_and_shapes(tiny_loaded, tmp_path):
    from safetensors.torch import load_file
    model, cfg, _ = tiny_loaded
    counts = torch.arange(cfg.vocab_size)
    d2t, t2d = choose_draft_vocab(counts, 40)
    head = new_eagle3_head(model, cfg, d2t, t2d, seed=0, device="cpu")
    out = export_head(head, tmp_path / "e3")
    tensors = load_file(str(out / "model.safetensors"))
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim
    dims = {"H": h, "2H": 2 * h, "3H": 3 * h, "Q": q, "KV": kv, "I": cfg.intermediate_size,
            "DV": 40, "V": cfg.vocab_size}
    assert set(tensors) == set(PUBLIC_EAGLE3)
    for name, shape in PUBLIC_EAGLE3.items():
        assert tuple(tensors[name].shape) == tuple(dims[s] for s in shape), name
        want = {"d2t": torch.int64, "t2d": torch.bool}.get(name, torch.bfloat16)
        assert tensors[name].dtype == want, name
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert conf["draft_vocab_size"] == 40 and conf["num_hidden_layers"] == 1
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == \
        list(head.aux_layer_ids)
    # the warm start: the LM head is the target's rows of the draft vocabulary
    assert torch.equal(head.lm_head_weight, model.lm_head_weight[draft_ids_of(d2t)].float())


@pytest.mark.parametrize("method,own_norm", [("eagle3", False), ("mtp", False), ("mtp", True)])
def test_export_then_load_gives_the_same_outputs(tiny_loaded, tmp_path, method, own_norm):
    """own_norm: MTP modules with their own final norm (shared_head.norm) keep it."""
    model, cfg, _ = tiny_loaded
    L = cfg.num_hidden_layers
    if method == "eagle3":
        d2t, t2d = choose_draft_vocab(torch.arange(cfg.vocab_size), 50)
        head = new_eagle3_head(model, cfg, d2t, t2d, seed=1, device="cpu")
    else:
        head = new_mtp_head(model, cfg, 2, seed=1, device="cpu", shared_head_norm=own_norm)
    with torch.no_grad():  # move off the initialisation so every tensor matters
        for p in head.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = export_head(head, tmp_path / method, torch.float32)
    loaded = load_draft_head(method, out, cfg, first_layer_slot=L)
    if method == "mtp":
        assert loaded.has_shared_head_norm == own_norm
        again = head_from_export(method, out, model, cfg, "cpu")  # train-draft --init-head
        assert export_weights(again).keys() == export_weights(head).keys()
    # the loader gives a CPU head the target's fast weight copies; the same for the original,
    # so both compute through the same kernels
    add_weight_copies_(head, torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (6,), generator=g)
    hidden = torch.randn(6, cfg.hidden_size, generator=g)
    results = []
    for h in (head.eval(), loaded):
        r = PagedRunner(model, num_seqs=1, max_len=16, num_slots=L + 2)
        meta, pos = r.meta({0: 6})
        ctx = ForwardContext(r.backend, meta)
        with torch.no_grad():
            if method == "eagle3":
                y = h.compute_draft_logits(h(hidden, ids, pos, ctx, embed_fn=model.embed_tokens))
                results.append((y, h.draft_to_target(y.argmax(-1))))
            else:
                y = h.compute_logits(h(1, hidden, ids, pos, ctx, embed_fn=model.embed_tokens),
                                     model, 1)
                results.append((y, y.argmax(-1)))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    assert torch.equal(results[0][1], results[1][1])


def test_a_grown_draft_vocabulary_keeps_the_heads_ids_and_adds_the_most_frequent():
    from outpace.training.draft_vocab import choose_draft_vocab, draft_ids_of, grow_draft_vocab
    counts = torch.tensor([5, 0, 9, 1, 7, 3, 3, 0, 2, 8])
    # a head whose ids are not the most frequent: 1 (unseen) and 3 (rare)
    kept = torch.tensor([1, 3])
    d2t, grown = grow_draft_vocab(counts, kept, 5)
    assert draft_ids_of(d2t).tolist() == [1, 2, 3, 4, 9]  # kept 1, 3; added 2, 9, 4 by count
    assert grown.sum() == 5 and bool(grown[draft_ids_of(d2t)].all())
    # ties go to the lower id; growing to the same size changes nothing
    d2t, grown = grow_draft_vocab(counts, kept, 7)
    assert draft_ids_of(d2t).tolist() == [0, 1, 2, 3, 4, 5, 9]
    same, _ = grow_draft_vocab(counts, kept, 2)
    assert draft_ids_of(same).tolist() == [1, 3]
    # a vocabulary chosen by frequency grows into the larger frequency choice
    d2t8, _ = choose_draft_vocab(counts, 4)
    assert torch.equal(grow_draft_vocab(counts, draft_ids_of(d2t8), 6)[0],
                       choose_draft_vocab(counts, 6)[0])
    with pytest.raises(ValueError, match="must hold 2..10"):
        grow_draft_vocab(counts, kept, 1)
