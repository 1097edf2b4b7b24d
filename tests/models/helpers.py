"""Shared helpers for the model tests: tiny HF models, a paged KV pool and metadata, one forward."""

from __future__ import annotations

import torch

from outpace.attention.base import AttentionMetadata, ForwardContext
from outpace.attention.torch_ref import TorchRefBackend

BLOCK = 4  # small blocks so short sequences span several pages


def randomize_(model, seed: int = 0, std: float = 0.15) -> None:
    """Larger-than-default random weights so logits differ meaningfully between tokens."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def tiny_hf(family: str, seed: int = 0, **overrides):
    """A tiny random transformers model of `family`, fp32, eval mode; `overrides`: config
    values in place of the tiny defaults (vocab_size, num_key_value_heads, ...)."""
    import transformers as tf
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    common.update(overrides)
    if family == "llama":
        cfg = tf.LlamaConfig(**common)
    elif family == "llama_bias":
        cfg = tf.LlamaConfig(**common, attention_bias=True)
    elif family == "llama3_rope":
        cfg = tf.LlamaConfig(**{**common, "rope_theta": 500000.0}, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif family == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=None)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**common)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=24)  # head_dim != hidden/heads
    elif family == "smollm2":
        # SmolLM2-135M's shape in miniature: tied embeddings, 9 query heads over 3 KV heads
        cfg = tf.LlamaConfig(**{**common, "tie_word_embeddings": True, "hidden_size": 72,
                                "num_attention_heads": 9, "num_key_value_heads": 3})
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(model, seed)
    return model.eval()


def word_tokenizer(folder, vocab_size: int = 96) -> None:
    """Save a word-level tokenizer of `vocab_size` ids (<unk>, <s>, </s>, w0, w1, ...) into
    `folder`: what a model folder needs to load through load_model, with no real model."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    raw = RawTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)


class PagedRunner:
    """A KV pool, TorchRefBackend and block tables for a few sequences; runs forward steps."""

    def __init__(self, model, num_seqs: int = 2, max_len: int = 64, num_slots=None):
        c = model.config
        self.model = model
        self.blocks_per_seq = (max_len + BLOCK - 1) // BLOCK
        nblocks = 1 + num_seqs * self.blocks_per_seq  # block 0 is the null block
        slots = num_slots or c.num_hidden_layers
        self.kv = torch.zeros(slots, 2, nblocks, BLOCK, c.num_key_value_heads, c.head_dim,
                              dtype=model.dtype)
        self.backend = TorchRefBackend(self.kv, c.num_attention_heads, c.num_key_value_heads,
                                       c.head_dim, c.head_dim ** -0.5)
        # sequence s owns blocks 1 + s*bps ..; reversed so pages are not in position order
        self.tables = torch.stack([
            torch.arange(1 + (s + 1) * self.blocks_per_seq - 1, s * self.blocks_per_seq, -1)
            for s in range(num_seqs)]).int()
        self.lens = [0] * num_seqs

    def meta(self, chunks: dict) -> AttentionMetadata:
        """chunks: {seq: n_new_tokens}; advances the sequence lengths."""
        slots, qsl, seq_lens, tables, positions = [], [0], [], [], []
        for s, n in chunks.items():
            start = self.lens[s]
            for p in range(start, start + n):
                slots.append(int(self.tables[s, p // BLOCK]) * BLOCK + p % BLOCK)
                positions.append(p)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            tables.append(self.tables[s])
            self.lens[s] += n
        m = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.stack(tables), query_start_loc_host=qsl,
            seq_lens_host=seq_lens, max_query_len=max(chunks.values()),
            max_seq_len=max(seq_lens))
        return m, torch.tensor(positions, dtype=torch.long)

    @torch.inference_mode()
    def step(self, chunks: dict, capture_layers=()):
        """chunks: {seq: list of new token ids} -> (logits [T, V], aux)."""
        meta, pos = self.meta({s: len(t) for s, t in chunks.items()})
        ids = torch.tensor([t for toks in chunks.values() for t in toks], dtype=torch.long)
        hidden, aux = self.model(ids, pos, ForwardContext(self.backend, meta),
                                 capture_layers=capture_layers)
        return self.model.compute_logits(hidden), aux


@torch.inference_mode()
def hf_logits(hf_model, ids, output_hidden_states=False):
    out = hf_model(torch.tensor([ids]), output_hidden_states=output_hidden_states)
    if output_hidden_states:
        return out.logits[0].float(), [h[0] for h in out.hidden_states]
    return out.logits[0].float()


# ---- GGUF files written from HF models (what llama.cpp's converter does, in miniature) ------

_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, i, *rest = hf_name.split(".")
    mod, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{i}.{_GGUF_LAYER[mod]}.{kind}"


def llama_cpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf's q/k row permutation (rotate_half -> interleaved rope)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def quant_roundtrip(w, qtype_name: str):
    """What a quantized tensor dequantizes to, computed with gguf's numpy reference code."""
    import gguf
    import numpy as np
    qt = gguf.GGMLQuantizationType[qtype_name]
    a = w.detach().float().numpy()
    if qtype_name == "F32" or a.ndim == 1:
        return torch.from_numpy(a.copy())
    q = gguf.quants.quantize(a, qt)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(q, qt)).reshape(a.shape))


class _OverridingWriter:
    """A GGUFWriter whose add_* calls named in `values` write those values instead; a callable
    value is called with the writer in place of the call (to write another type, or nothing)."""

    def __init__(self, writer, values: dict):
        self._w, self._values = writer, values

    def __getattr__(self, name):
        fn = getattr(self._w, name)
        if name in self._values:
            v = self._values[name]
            return (lambda *a, **kw: v(self._w)) if callable(v) else (lambda *a, **kw: fn(v))
        return fn


def write_gguf(hf_model, path, qtype_name: str = "F32", arch: str = "llama",
               rope_freqs=None, skip=(), override_qtype=None, metadata=None, extra_kv=None):
    """Write `hf_model` as a GGUF the way llama.cpp does; 2-D tensors stored as `qtype_name`.
    metadata: {GGUFWriter add_* method name: value} replacing what the model says (bad files);
    extra_kv: {key: str | float (float32) | bool | int (uint32) | list (array)} written
    besides."""
    import gguf
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    if metadata:
        w = _OverridingWriter(w, metadata)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, v in (extra_kv or {}).items():
        if isinstance(v, str):
            w.add_string(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, list):
            w.add_array(key, v)
        else:
            w.add_uint32(key, v)
    qt = gguf.GGMLQuantizationType[qtype_name]
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings or name in skip:
            continue
        a = t.detach().float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            a = llama_cpp_permute(a, heads)
        gname = gguf_name(name)
        this_qt = (override_qtype or {}).get(gname, qt)
        if a.ndim == 1 or this_qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, a)
        elif this_qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, a.astype("float16"))
        else:
            w.add_tensor(gname, gguf.quants.quantize(a, this_qt), raw_dtype=this_qt)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_with_quantized_weights(hf_model, qtype_name: str):
    """A copy of `hf_model` whose weights are what the GGUF holds after quantization."""
    import copy
    ref = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 2:
                p.copy_(quant_roundtrip(p, qtype_name))
    return ref
