"""The trainer's dense target forward against the engine's paged forward (tiny target, fp32)."""

from __future__ import annotations

import torch

from outpace.training.target_features import target_features
from tests.models.helpers import PagedRunner


def test_dense_features_equal_the_engine_forward(tiny_loaded):
    model, cfg, _ = tiny_loaded
    g = torch.Generator().manual_seed(0)
    lens = [11, 7]
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lens]
    batch = torch.zeros(2, max(lens), dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, :len(s)] = s
    capture = (1, 2, 0)
    vocab = torch.tensor([3, 5, 8, 40, 95])
    feats = target_features(model, batch, capture, want_hidden=True, vocab_ids=vocab)
    full = target_features(model, batch, capture)
    assert feats.aux.shape == (2, max(lens), 3 * cfg.hidden_size)
    for i, s in enumerate(seqs):
        r = PagedRunner(model, num_seqs=1, max_len=32)
        logits, aux = r.step({0: s.tolist()}, capture_layers=capture)
        n = len(s)
        torch.testing.assert_close(full.logits[i, :n], logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(feats.logits[i, :n], logits[:, vocab], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(feats.aux[i, :n], torch.cat(aux, -1), rtol=1e-4, atol=1e-4)
        assert torch.equal(feats.argmax[i, :n], logits.argmax(-1))
        # MTP's h^0 is the final-normed hidden whose LM head gives the logits
        torch.testing.assert_close(feats.hidden[i, :n] @ model.lm_head_weight.T, logits,
                                   rtol=1e-4, atol=1e-4)
