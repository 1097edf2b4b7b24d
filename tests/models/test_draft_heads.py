"""EAGLE-3 and MTP draft heads: init-draft -> load round trip, load-time validation, and the
forward pass over a paged KV pool against one-sequence-at-a-time runs and an independent dense
reference (plain causal attention written here from the checkpoint tensors)."""

import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from outpace.attention.base import AttentionMetadata, ForwardContext
from outpace.attention.torch_ref import TorchRefBackend
from outpace.errors import ConfigError, ModelLoadError
from outpace.kernels.options import use_kernel_options
from outpace.model_config import ModelConfig
from outpace.models.draft_loader import export_weights, load_draft_head, model_config_dict
from outpace.models.llama import LlamaForCausalLM
from outpace.runner_config import KernelOptions
from outpace.training.init_draft import init_draft

L = 6  # target layers: default EAGLE-3 aux layers (1, 2, 2)


def target_config(arch="llama", **over):
    kw = dict(architecture=arch, vocab_size=97, hidden_size=32, intermediate_size=48,
              num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
              attention_bias=arch == "qwen2", qk_norm=arch == "qwen3")
    kw.update(over)
    return ModelConfig(**kw)


def write_target(tmp_path, cfg, name="target"):
    """A target folder as init-draft reads it (config.json is all it needs)."""
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(model_config_dict(cfg)))
    return d


def make_head(tmp_path, method, cfg, **kw):
    return init_draft(method, str(write_target(tmp_path, cfg)), tmp_path / method, quiet=True,
                      **kw)


def rewrite(folder, fn):
    """Edit a head's model.safetensors in place: fn(tensors dict) mutates it."""
    f = folder / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f))


def edit_config(folder, fn):
    d = json.loads((folder / "config.json").read_text())
    fn(d)
    (folder / "config.json").write_text(json.dumps(d))


def randomize(folder, seed):
    """Replace every float tensor by a strong random one (norms around 1, biases non-zero), so
    that a swapped norm or a dropped bias changes the output."""
    g = torch.Generator().manual_seed(seed)

    def fn(t):
        for n, x in t.items():
            if x.is_floating_point():
                r = torch.randn(x.shape, generator=g)
                t[n] = 1 + 0.2 * r if n.endswith("norm.weight") else 0.2 * r
    rewrite(folder, fn)


# ---- round trip and validation --------------------------------------------------------------


@pytest.mark.parametrize("method,kw", [("eagle3", {}), ("eagle3", {"draft_vocab_size": 40}),
                                       ("mtp", {"num_layers": 2})])
def test_init_draft_load_round_trip(tmp_path, method, kw):
    cfg = target_config()
    out = make_head(tmp_path, method, cfg, **kw)
    head = load_draft_head(method, out, cfg, first_layer_slot=L)
    saved = load_file(str(out / "model.safetensors"))
    loaded = export_weights(head)
    assert saved.keys() == loaded.keys()
    for n in saved:
        assert torch.equal(saved[n], loaded[n]), n
    # deterministic from the seed, and the seed matters
    again = init_draft(method, str(tmp_path / "target"), tmp_path / "again", quiet=True, **kw)
    other = init_draft(method, str(tmp_path / "target"), tmp_path / "other", seed=1, quiet=True,
                       **kw)
    a, b = load_file(str(again / "model.safetensors")), load_file(str(other / "model.safetensors"))
    assert all(torch.equal(saved[n], a[n]) for n in saved)
    assert any(not torch.equal(saved[n], b[n]) for n in saved if saved[n].is_floating_point())
    if method == "eagle3":
        dv = kw.get("draft_vocab_size", cfg.vocab_size)
        assert head.lm_head_weight.shape == (dv, cfg.hidden_size)
        assert head.aux_layer_ids == (1, 2, 2)
        assert int(head.t2d.sum()) == dv and bool(head.t2d[:dv].all())
        assert torch.equal(head.draft_to_target(torch.arange(dv)), torch.arange(dv))
        assert head.midlayer.layer_slot == L
        assert "embed_tokens.weight" not in saved  # the target's embedding is shared
    else:
        assert [m.layer.layer_slot for m in head.layers] == [L, L + 1]
        assert saved["layers.1.enorm.weight"].eq(1).all()  # norms start at one
        std = saved["layers.0.eh_proj.weight"].std().item()
        assert 0.015 < std < 0.025


def test_released_layout_is_read(tmp_path):
    """pytorch_model.bin with `model.layers.0.` names (vLLM-style exports) loads the same."""
    cfg = target_config()
    out = make_head(tmp_path, "eagle3", cfg)
    t = load_file(str(out / "model.safetensors"))
    renamed = {("model.layers.0." + n[len("midlayer."):] if n.startswith("midlayer.") else n): x
               for n, x in t.items()}
    del renamed["t2d"]  # derived from d2t when absent
    (out / "model.safetensors").unlink()
    torch.save(renamed, out / "pytorch_model.bin")
    head = load_draft_head("eagle3", out, cfg, L)
    loaded = export_weights(head)
    assert all(torch.equal(t[n], loaded[n]) for n in t)


def err(method, folder, cfg, *needles):
    with pytest.raises(ModelLoadError) as e:
        load_draft_head(method, folder, cfg, L)
    msg = str(e.value)
    for n in needles:
        assert n in msg, msg
    return msg


def test_missing_folder_and_files(tmp_path):
    cfg = target_config()
    err("eagle3", tmp_path / "nope", cfg, "does not exist")
    out = make_head(tmp_path, "eagle3", cfg)
    (out / "model.safetensors").unlink()
    err("eagle3", out, cfg, "no *.safetensors")
    (out / "config.json").unlink()
    err("eagle3", out, cfg, "config.json")


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_target_mismatch(tmp_path, method):
    cfg = target_config()
    out = make_head(tmp_path, method, cfg)
    err(method, out, target_config(hidden_size=48), "hidden_size=32", "hidden_size=48")
    err(method, out, target_config(vocab_size=100), "vocab_size=97", "vocab_size=100")
    err(method, out, target_config(num_key_value_heads=4), "num_key_value_heads=2")
    err(method, out, target_config(head_dim=16), "head_dim=8")


def test_eagle3_shape_and_vocab_map_errors(tmp_path):
    cfg = target_config()
    out = make_head(tmp_path, "eagle3", cfg, draft_vocab_size=40)
    rewrite(out, lambda t: t.update({"fc.weight": torch.zeros(32, 64)}))
    err("eagle3", out, cfg, "fc.weight", "(32, 64)", "(32, 96)")
    rewrite(out, lambda t: t.update({"fc.weight": torch.zeros(32, 96),
                                     "d2t": torch.full((40,), 60, dtype=torch.int64)}))
    err("eagle3", out, cfg, "d2t", "[60, 99]", "[0, 97)")
    rewrite(out, lambda t: t.update({"d2t": torch.zeros(40, dtype=torch.int64),
                                     "t2d": torch.ones(90, dtype=torch.bool)}))
    err("eagle3", out, cfg, "t2d", "97")
    rewrite(out, lambda t: (t.update({"t2d": torch.ones(97, dtype=torch.bool)}),
                            t.pop("midlayer.mlp.up_proj.weight")))
    err("eagle3", out, cfg, "lacks", "midlayer.mlp.up_proj.weight")


def test_eagle3_aux_layer_errors(tmp_path):
    cfg = target_config()
    out = make_head(tmp_path, "eagle3", cfg)
    edit_config(out, lambda d: d["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2,
                                                                                         9]))
    err("eagle3", out, cfg, "eagle_aux_hidden_state_layer_ids", "[9]", "6 layers")
    edit_config(out, lambda d: d.pop("eagle_config"))
    assert load_draft_head("eagle3", out, cfg, L).aux_layer_ids == (1, 2, 2)  # the default
    err("eagle3", out, target_config(num_hidden_layers=3), "default aux layers", "[-1]")
    edit_config(out, lambda d: d.update(num_hidden_layers=2))
    err("eagle3", out, cfg, "num_hidden_layers=2")


def test_mtp_config_errors(tmp_path):
    cfg = target_config()
    out = make_head(tmp_path, "mtp", cfg, num_layers=2)
    edit_config(out, lambda d: d.update(num_nextn_predict_layers=0))
    err("mtp", out, cfg, "num_nextn_predict_layers=0")
    edit_config(out, lambda d: d.update(num_nextn_predict_layers=3))
    err("mtp", out, cfg, "lacks", "layers.2.")
    edit_config(out, lambda d: d.update(num_nextn_predict_layers=2))
    rewrite(out, lambda t: t.update({"layers.1.eh_proj.weight": torch.zeros(32, 32)}))
    err("mtp", out, cfg, "layers.1.eh_proj.weight", "(32, 32)", "(32, 64)")


def test_init_draft_option_errors(tmp_path):
    target = str(write_target(tmp_path, target_config()))
    with pytest.raises(ConfigError, match="num-layers"):
        init_draft("eagle3", target, tmp_path / "a", quiet=True, num_layers=2)
    with pytest.raises(ConfigError, match="num-layers"):
        init_draft("mtp", target, tmp_path / "b", quiet=True, num_layers=0)
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        init_draft("eagle3", target, tmp_path / "c", quiet=True, draft_vocab_size=98)
    with pytest.raises(ModelLoadError):
        init_draft("mtp", str(tmp_path / "no-target"), tmp_path / "d", quiet=True)
    init_draft("mtp", target, tmp_path / "e", quiet=True)
    before = (tmp_path / "e" / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="already holds a draft head"):
        init_draft("mtp", target, tmp_path / "e", quiet=True, seed=1)
    assert (tmp_path / "e" / "model.safetensors").read_bytes() == before


# ---- forward: packed paged == one at a time == dense reference ------------------------------


class Pool:
    """A paged KV pool (target slots + draft slots) with shuffled, non-contiguous blocks."""

    def __init__(self, cfg, num_slots, block_size=4, num_blocks=48, seed=0):
        kv = torch.zeros(num_slots, 2, num_blocks, block_size, cfg.num_key_value_heads,
                         cfg.head_dim)
        self.backend = TorchRefBackend(kv, cfg.num_attention_heads, cfg.num_key_value_heads,
                                       cfg.head_dim, cfg.head_dim ** -0.5)
        self.bs = block_size
        self.free = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed))
        self.free = (self.free + 1).tolist()  # block 0 is the null block
        self.tables, self.lens = {}, {}

    def step(self, chunks):
        """chunks: [(seq, n_new)] -> (ForwardContext, positions [T])."""
        slots, pos, qsl, lens = [], [], [0], []
        for s, n in chunks:
            start = self.lens.get(s, 0)
            table = self.tables.setdefault(s, [])
            while len(table) * self.bs < start + n:
                table.append(self.free.pop())
            for p in range(start, start + n):
                slots.append(table[p // self.bs] * self.bs + p % self.bs)
                pos.append(p)
            self.lens[s] = start + n
            qsl.append(qsl[-1] + n)
            lens.append(start + n)
        width = max(len(self.tables[s]) for s, _ in chunks)
        bt = torch.zeros(len(chunks), width, dtype=torch.int32)
        for i, (s, _) in enumerate(chunks):
            bt[i, :len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=bt,
            query_start_loc_host=qsl, seq_lens_host=lens,
            max_query_len=max(n for _, n in chunks), max_seq_len=max(lens))
        return ForwardContext(self.backend, meta), torch.tensor(pos)


CHUNKS = {0: [5, 4, 2], 1: [6], 2: [3, 6], 3: [1, 1, 1]}  # seq -> tokens per step


def run_paged(cfg, num_slots, rows_fn, packed):
    """rows_fn(seq, lo, hi, positions, ctx) -> [hi-lo, H]; steps packed or one seq per call."""
    pool = Pool(cfg, num_slots)
    done = {s: 0 for s in CHUNKS}
    out = {s: [] for s in CHUNKS}
    for i in range(max(len(c) for c in CHUNKS.values())):
        step = [(s, c[i]) for s, c in CHUNKS.items() if i < len(c)]
        groups = [step] if packed else [[x] for x in step]
        for g in groups:
            ctx, pos = pool.step(g)
            y = rows_fn([(s, done[s], done[s] + n) for s, n in g], pos, ctx)
            a = 0
            for s, n in g:
                out[s].append(y[a:a + n])
                done[s] += n
                a += n
    return {s: torch.cat(v) for s, v in out.items()}, pool


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def ref_layer(sd, p, cfg, resid, attn_in, pos):
    """Dense Llama-family decoder layer (HF semantics), causal over the whole sequence."""
    t, hq, hkv, d = resid.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def lin(x, n):
        b = sd.get(f"{p}{n}.bias")
        return x @ sd[f"{p}{n}.weight"].T + (0 if b is None else b)
    q = lin(attn_in, "self_attn.q_proj").view(t, hq, d)
    k = lin(attn_in, "self_attn.k_proj").view(t, hkv, d)
    v = lin(attn_in, "self_attn.v_proj").view(t, hkv, d)
    if cfg.qk_norm:
        q, k = rms(q, sd[p + "self_attn.q_norm.weight"]), rms(k, sd[p + "self_attn.k_norm.weight"])
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2).float() / d)
    ang = torch.cat([pos[:, None].float() * inv] * 2, -1)[:, None]  # [T, 1, D]

    def rot(x):
        return x * ang.cos() + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * ang.sin()
    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, hq * d)
    h = resid + lin(o, "self_attn.o_proj")
    x = rms(h, sd[p + "post_attention_layernorm.weight"])
    return h + lin(F.silu(lin(x, "mlp.gate_proj")) * lin(x, "mlp.up_proj"), "mlp.down_proj")


def seq_data(cfg, g, n_aux):
    """Per sequence: n_aux hidden inputs [n, H] and input ids [n]."""
    data = {}
    for s, c in CHUNKS.items():
        n = sum(c)
        data[s] = ([torch.randn(n, cfg.hidden_size, generator=g) for _ in range(n_aux)],
                   torch.randint(0, cfg.vocab_size, (n,), generator=g))
    return data


def eagle3_rows(head, data, embed):
    """run_paged's step function for an EAGLE-3 head over seq_data's sequences: each packed
    part (seq, start, end) contributes its aux hidden states and ids."""
    def rows(parts, pos, ctx):
        aux = [torch.cat([data[s][0][j][a:b] for s, a, b in parts]) for j in range(3)]
        ids = torch.cat([data[s][1][a:b] for s, a, b in parts])
        return head(head.fuse(aux), ids, pos, ctx, lambda i: F.embedding(i, embed))
    return rows


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3_forward_matches_references(tmp_path, norm_before_residual):
    cfg = target_config()
    out = make_head(tmp_path, "eagle3", cfg, draft_vocab_size=50)
    if norm_before_residual:
        edit_config(out, lambda d: d.update(norm_before_residual=True))
    randomize(out, seed=1)
    g = torch.Generator().manual_seed(2)
    dv = 50
    sub = torch.randperm(cfg.vocab_size, generator=g)[:dv].sort().values
    rewrite(out, lambda t: t.update({"d2t": sub - torch.arange(dv),
                                     "t2d": torch.zeros(97, dtype=torch.bool).index_fill(0, sub,
                                                                                        True)}))
    head = load_draft_head("eagle3", out, cfg, first_layer_slot=L)
    sd = load_file(str(out / "model.safetensors"))
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    data = seq_data(cfg, g, 3)

    rows = eagle3_rows(head, data, embed)

    with torch.no_grad():
        packed, pool = run_paged(cfg, L + 1, rows, packed=True)
        single, _ = run_paged(cfg, L + 1, rows, packed=False)
        assert pool.backend.kv_cache[:L].eq(0).all()  # the draft plane only: slot L
        assert pool.backend.kv_cache[L].ne(0).any()
        for s, (aux, ids) in data.items():
            pos = torch.arange(len(ids))
            fused = torch.cat(aux, -1) @ sd["fc.weight"].T
            normed = rms(fused, sd["midlayer.hidden_norm.weight"])
            attn_in = torch.cat([rms(embed[ids], sd["midlayer.input_layernorm.weight"]), normed],
                                -1)
            resid = normed if norm_before_residual else fused
            ref = ref_layer(sd, "midlayer.", cfg, resid, attn_in, pos)
            torch.testing.assert_close(packed[s], single[s], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(packed[s], ref, rtol=1e-5, atol=1e-5)
            logits = head.compute_draft_logits(packed[s])
            ref_logits = rms(ref, sd["norm.weight"]) @ sd["lm_head.weight"].T
            assert logits.dtype == torch.float32 and logits.shape == (len(ids), dv)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(head.draft_to_target(torch.arange(dv)), sub)
        assert torch.equal(head.t2d.nonzero().flatten(), sub)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_mtp_forward_matches_references(tmp_path, arch):
    cfg = target_config(arch)
    out = make_head(tmp_path, "mtp", cfg, num_layers=2)
    randomize(out, seed=3)
    head = load_draft_head("mtp", out, cfg, first_layer_slot=L)
    sd = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(4)
    target = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for prm in target.parameters():
            prm.copy_(0.3 * torch.randn(prm.shape, generator=g))
    data = seq_data(cfg, g, 1)

    def chain(parts, pos, ctx):
        # depth 0 reads the target hidden, depth 1 reads depth 0's output (its own KV slot)
        h = torch.cat([data[s][0][0][a:b] for s, a, b in parts])
        ids = torch.cat([data[s][1][a:b] for s, a, b in parts])
        h0 = head(0, h, ids, pos, ctx, target.embed_tokens)
        return torch.cat([h0, head(1, h0, ids, pos, ctx, target.embed_tokens)], -1)

    with torch.no_grad():
        packed, pool = run_paged(cfg, L + 2, chain, packed=True)
        single, _ = run_paged(cfg, L + 2, chain, packed=False)
        assert pool.backend.kv_cache[:L].eq(0).all()
        assert pool.backend.kv_cache[L:].flatten(1).ne(0).any(1).all()  # both draft slots
        for s, ((h,), ids) in data.items():
            pos = torch.arange(len(ids))
            refs = []
            for d in range(2):
                p = f"layers.{d}."
                x = torch.cat([rms(target.embed_weight[ids], sd[p + "enorm.weight"]),
                               rms(h, sd[p + "hnorm.weight"])], -1) @ sd[p + "eh_proj.weight"].T
                h = ref_layer(sd, p, cfg, x, rms(x, sd[p + "input_layernorm.weight"]), pos)
                refs.append(h)
            ref = torch.cat(refs, -1)
            torch.testing.assert_close(packed[s], single[s], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(packed[s], ref, rtol=1e-5, atol=1e-5)
            logits = head.compute_logits(packed[s][:, :cfg.hidden_size], target)
            ref_logits = rms(refs[0], target.norm.weight) @ target.lm_head_weight.T
            torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_mtp_shared_head_norm_is_loaded_and_used(tmp_path, caplog):
    """A DeepSeek-layout head: each module's shared_head.norm is the norm before the LM head
    (its logits equal a dense reference through it, not through the target's final norm);
    shared_head.head, a copy of the target's LM head, is dropped without a warning."""
    cfg = target_config()
    out = make_head(tmp_path, "mtp", cfg, num_layers=2)
    randomize(out, seed=5)
    g = torch.Generator().manual_seed(6)
    target = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for prm in target.parameters():
            prm.copy_(0.3 * torch.randn(prm.shape, generator=g))
    norms = [torch.rand(cfg.hidden_size, generator=g) * 3 for _ in range(2)]
    rewrite(out, lambda t: t.update({
        **{f"model.layers.{d}.shared_head.norm.weight": norms[d] for d in range(2)},
        **{f"model.layers.{d}.shared_head.head.weight": target.lm_head_weight.detach().clone()
           for d in range(2)}}))
    with caplog.at_level(logging.WARNING, logger="outpace.models.draft_loader"):
        head = load_draft_head("mtp", out, cfg, first_layer_slot=L)
    assert head.has_shared_head_norm and not caplog.records, caplog.text
    h = torch.randn(5, cfg.hidden_size, generator=g)
    with torch.no_grad():
        for d in range(2):
            want = rms(h, norms[d]) @ target.lm_head_weight.T
            got = head.compute_logits(h, target, d)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            through_target = rms(h, target.norm.weight) @ target.lm_head_weight.T
            assert not torch.allclose(got, through_target, atol=1e-2)
    # a head without the norms reads the target's
    (tmp_path / "plain").mkdir()
    plain = make_head(tmp_path / "plain", "mtp", cfg, num_layers=2)
    head = load_draft_head("mtp", plain, cfg, first_layer_slot=L)
    assert not head.has_shared_head_norm
    with torch.no_grad():
        torch.testing.assert_close(head.compute_logits(h, target, 1),
                                   rms(h, target.norm.weight) @ target.lm_head_weight.T,
                                   rtol=1e-5, atol=1e-5)


def test_mtp_shared_head_errors(tmp_path):
    cfg = target_config()
    out = make_head(tmp_path, "mtp", cfg, num_layers=2)
    rewrite(out, lambda t: t.update({"layers.1.shared_head.norm.weight": torch.ones(32)}))
    err("mtp", out, cfg, "module(s) [0] lack their shared_head.norm.weight")
    rewrite(out, lambda t: t.update({"layers.0.shared_head.norm.weight": torch.ones(32),
                                     "layers.0.shared_head.head.weight": torch.ones(96, 32)}))
    err("mtp", out, cfg, "layers.0.shared_head.head.weight", "(96, 32)", "(97, 32)")


# ---- the CUDA few-row path (LlamaDecoderLayer.forward_few_rows), run through the references --


def take_few_rows_path(monkeypatch):
    """From here on the heads take their CUDA code path: use_triton True where the models read
    it (the few-row dispatchers read their own, so on CPU they run their PyTorch references,
    and rope goes through the backend's forward_rope). Returns the layer slots that
    forward_few_rows ran, one per call."""
    import outpace.models.llama as llama
    import outpace.models.rotary as rotary
    for mod in (llama, rotary):  # (the heads ask LlamaDecoderLayer.takes_few_rows)
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    calls, orig = [], llama.LlamaDecoderLayer.forward_few_rows

    def spy(self, *a, **kw):
        calls.append(self.layer_slot)
        return orig(self, *a, **kw)
    monkeypatch.setattr(llama.LlamaDecoderLayer, "forward_few_rows", spy)
    return calls


# Packed steps of CHUNKS: 15, 11 and 3 rows, all within SMALL_M_MAX
PACKED_STEPS = max(len(c) for c in CHUNKS.values())


@pytest.mark.parametrize("fused_qkv", [False, True], ids=["rope-kernel", "qkv-rope-store"])
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3_few_rows_path_matches(tmp_path, monkeypatch, norm_before_residual, fused_qkv):
    """The head's CUDA path (qkv over the given [emb, hidden] input, fused residual adds) gives
    the outputs and draft-plane KV of its layer-by-layer path. The fused qkv + rope + store
    kernel (KernelOptions.fused_qkv_rope_store) must not change it: the fused kernel norms the
    residual, which is not EAGLE-3's attention input."""
    cfg = target_config()
    out = make_head(tmp_path, "eagle3", cfg)
    if norm_before_residual:
        edit_config(out, lambda d: d.update(norm_before_residual=True))
    randomize(out, seed=5)
    head = load_draft_head("eagle3", out, cfg, first_layer_slot=L)
    g = torch.Generator().manual_seed(6)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    data = seq_data(cfg, g, 3)

    rows = eagle3_rows(head, data, embed)

    with torch.no_grad():
        ref, ref_pool = run_paged(cfg, L + 1, rows, packed=True)
        calls = take_few_rows_path(monkeypatch)
        with use_kernel_options(KernelOptions(fused_qkv_rope_store=fused_qkv)):
            got, pool = run_paged(cfg, L + 1, rows, packed=True)
    assert calls == [L] * PACKED_STEPS
    for s in CHUNKS:
        torch.testing.assert_close(got[s], ref[s], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.backend.kv_cache, ref_pool.backend.kv_cache, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("fused_qkv", [False, True], ids=["rope-kernel", "qkv-rope-store"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_mtp_few_rows_path_matches(tmp_path, monkeypatch, arch, fused_qkv):
    """Each MTP module's CUDA path (its layer normalizes eh_proj's output itself) gives the
    outputs and KV of the layer-by-layer path; Qwen2's biased layer keeps the general path."""
    cfg = target_config(arch)
    out = make_head(tmp_path, "mtp", cfg, num_layers=2)
    randomize(out, seed=7)
    head = load_draft_head("mtp", out, cfg, first_layer_slot=L)
    g = torch.Generator().manual_seed(8)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    data = seq_data(cfg, g, 1)

    def chain(parts, pos, ctx):  # depth 1 reads depth 0's output, each in its own KV slot
        h = torch.cat([data[s][0][0][a:b] for s, a, b in parts])
        ids = torch.cat([data[s][1][a:b] for s, a, b in parts])
        h0 = head(0, h, ids, pos, ctx, lambda i: F.embedding(i, embed))
        return torch.cat([h0, head(1, h0, ids, pos, ctx, lambda i: F.embedding(i, embed))], -1)

    with torch.no_grad():
        ref, ref_pool = run_paged(cfg, L + 2, chain, packed=True)
        calls = take_few_rows_path(monkeypatch)
        with use_kernel_options(KernelOptions(fused_qkv_rope_store=fused_qkv)):
            got, pool = run_paged(cfg, L + 2, chain, packed=True)
    assert calls == ([] if arch == "qwen2" else [L, L + 1] * PACKED_STEPS)
    for s in CHUNKS:
        torch.testing.assert_close(got[s], ref[s], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.backend.kv_cache, ref_pool.backend.kv_cache, rtol=1e-5,
                               atol=1e-5)


# ---- the CUDA input path (kernels/embed_norm_cat.py), run through the kernel's reference ---------


def take_fused_input_path(monkeypatch):
    """From here on embed_norm_cat takes its kernel branch, with the PyTorch reference standing
    in for the kernel. Returns the number of calls so far (a one-item list)."""
    import outpace.kernels.embed_norm_cat as head_input
    calls = [0]

    def stand_in(*a, **kw):
        calls[0] += 1
        return head_input.embed_norm_cat_ref(*a, **kw)
    monkeypatch.setattr(head_input, "use_triton", lambda t: True)
    monkeypatch.setattr(head_input, "embed_norm_cat_triton", stand_in)
    return calls


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3_fused_input_path_matches(tmp_path, monkeypatch, norm_before_residual):
    """Given the embedding table, the head builds [in_norm(emb), hidden_norm(hidden)] in one
    embed_norm_cat (its second half the residual under norm_before_residual): the same outputs
    and draft-plane KV as the composition."""
    cfg = target_config()
    out = make_head(tmp_path, "eagle3", cfg)
    if norm_before_residual:
        edit_config(out, lambda d: d.update(norm_before_residual=True))
    randomize(out, seed=9)
    head = load_draft_head("eagle3", out, cfg, first_layer_slot=L)
    g = torch.Generator().manual_seed(10)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g).to(torch.bfloat16)
    data = seq_data(cfg, g, 3)

    def rows(parts, pos, ctx):
        aux = [torch.cat([data[s][0][j][a:b] for s, a, b in parts]) for j in range(3)]
        ids = torch.cat([data[s][1][a:b] for s, a, b in parts])
        # a bf16 table under fp32 activations: its rows are cast first, in both paths
        return head(head.fuse(aux), ids, pos, ctx, lambda i: F.embedding(i, embed).float(),
                    embed_weight=embed)

    with torch.no_grad():
        ref, ref_pool = run_paged(cfg, L + 1, rows, packed=True)
        calls = take_fused_input_path(monkeypatch)
        got, pool = run_paged(cfg, L + 1, rows, packed=True)
    assert calls[0] == PACKED_STEPS
    for s in CHUNKS:
        torch.testing.assert_close(got[s], ref[s], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool.backend.kv_cache, ref_pool.backend.kv_cache, rtol=1e-6,
                               atol=1e-6)


def test_mtp_fused_input_path_matches(tmp_path, monkeypatch):
    cfg = target_config()
    out = make_head(tmp_path, "mtp", cfg, num_layers=2)
    randomize(out, seed=11)
    head = load_draft_head("mtp", out, cfg, first_layer_slot=L)
    g = torch.Generator().manual_seed(12)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    data = seq_data(cfg, g, 1)

    def chain(parts, pos, ctx):
        h = torch.cat([data[s][0][0][a:b] for s, a, b in parts])
        ids = torch.cat([data[s][1][a:b] for s, a, b in parts])
        kw = dict(embed_fn=lambda i: F.embedding(i, embed), embed_weight=embed)
        h0 = head(0, h, ids, pos, ctx, **kw)
        return torch.cat([h0, head(1, h0, ids, pos, ctx, **kw)], -1)

    with torch.no_grad():
        ref, ref_pool = run_paged(cfg, L + 2, chain, packed=True)
        calls = take_fused_input_path(monkeypatch)
        got, pool = run_paged(cfg, L + 2, chain, packed=True)
    assert calls[0] == 2 * PACKED_STEPS
    for s in CHUNKS:
        torch.testing.assert_close(got[s], ref[s], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool.backend.kv_cache, ref_pool.backend.kv_cache, rtol=1e-6,
                               atol=1e-6)


def test_eagle3_greedy_target_ids(tmp_path):
    """The argmax with d2t added in (argmax_rows' offsets) maps like draft_to_target."""
    cfg = target_config()
    out = make_head(tmp_path, "eagle3", cfg, draft_vocab_size=40)
    randomize(out, seed=13)
    g = torch.Generator().manual_seed(14)
    sub = torch.randperm(cfg.vocab_size, generator=g)[:40].sort().values
    rewrite(out, lambda t: t.update({"d2t": sub - torch.arange(40)}))
    head = load_draft_head("eagle3", out, cfg, first_layer_slot=L)
    hidden = torch.randn(9, cfg.hidden_size, generator=g)
    with torch.no_grad():
        got = head.greedy_target_ids(hidden)
        assert torch.equal(got, head.draft_to_target(head.greedy_draft_ids(hidden)))
        assert torch.equal(got, sub[head.compute_draft_logits(hidden).argmax(-1)])


def test_side_by_side_views_join_without_a_copy():
    """EAGLE-3's fc reads the target's captured layers as one tensor when they are adjacent
    column blocks of one, in order; anything else is concatenated."""
    from outpace.models.eagle3 import side_by_side
    buf = torch.arange(24.0).view(2, 12)
    parts = [buf[:, 0:4], buf[:, 4:8], buf[:, 8:12]]
    joined = side_by_side(parts)
    assert joined is not None and joined.data_ptr() == buf.data_ptr()
    assert torch.equal(joined, torch.cat(parts, dim=-1))
    assert side_by_side(parts[::-1]) is None  # out of order
    assert side_by_side([p.clone() for p in parts]) is None  # separate tensors
    assert side_by_side(parts[:2]) is None  # the rows hold a third block
    other = torch.arange(24.0).view(2, 12)
    assert side_by_side([parts[0], other[:, 4:8], parts[2]]) is None


@pytest.mark.parametrize("made,asked", [("mtp", "eagle3"), ("eagle3", "mtp")])
def test_a_head_of_the_other_kind_is_named_as_such(tmp_path, made, asked):
    cfg = target_config()
    out = make_head(tmp_path, made, cfg)
    kind = {"eagle3": "an EAGLE-3", "mtp": "an MTP"}
    with pytest.raises(ModelLoadError, match=f"is {kind[made]} head, not {kind[asked]} one: use "
                                             f"it with --spec {made}"):
        load_draft_head(asked, out, cfg, first_layer_slot=L)


def _huge_weights(folder, name: str, gib: int = 4) -> None:
    """Replace the head's weights by one sparse file of `gib` GiB with a sound safetensors
    header naming one tensor (nothing is written to disk; reading it takes the whole size)."""
    n = gib << 30
    header = json.dumps({name: {"dtype": "F32", "shape": [n // 4],
                                       "data_offsets": [0, n]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + n)


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_a_head_that_does_not_fit_the_target_is_refused_before_its_weights_load(tmp_path,
                                                                              method):
    """The config's checks (shapes against the target's, the kind of head, a bad value) come
    before a weight is read or mapped: with weights of 4 GiB and 1 GiB of address space to
    spare, the config's error is the one raised (the control, a head that fits, fails on the
    weights)."""
    from tests.models.test_reader_fuzz import capped_address_space
    cfg = target_config()
    out = make_head(tmp_path, method, cfg)
    _huge_weights(out, "fc.weight" if method == "eagle3" else "layers.0.eh_proj.weight")
    other = "mtp" if method == "eagle3" else "eagle3"
    with capped_address_space(1 << 30):
        err(method, out, target_config(hidden_size=48), "hidden_size=32", "hidden_size=48")
        err(other, out, cfg, f"head, not an")
        with pytest.raises(BaseException) as control:
            load_draft_head(method, out, cfg, L)
    assert not isinstance(control.value, (AssertionError, KeyboardInterrupt))
    assert "hidden_size" not in str(control.value)
    edit_config(out, lambda d: d.update(rms_norm_eps="small"))
    with capped_address_space(1 << 30):
        err(method, out, cfg, "rms_norm_eps")
