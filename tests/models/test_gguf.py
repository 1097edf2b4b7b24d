"""GGUF loading: small files written with gguf.GGUFWriter from tiny HF models, and bad files."""

import gguf
import numpy as np
import pytest
import torch

from outpace.errors import ModelLoadError, UnsupportedModelError
from outpace.models.loader import load_model_config, locate
from outpace.models.loader.gguf import GGUFFile, load_gguf
from outpace.models.loader.gguf_quants import dequantize
from outpace.models.rotary import rope_inv_freq
from tests.models.helpers import (PagedRunner, hf_logits, hf_with_quantized_weights, tiny_hf,
                                  write_gguf)

IDS = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def hf_llama():
    return tiny_hf("llama", seed=11)


def _ours(path):
    model, cfg, _ = load_gguf(path, quiet=True)
    return PagedRunner(model, num_seqs=1).step({0: IDS})[0], cfg


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_llama_gguf_matches_hf(hf_llama, tmp_path, qtype):
    path = write_gguf(hf_llama, tmp_path / f"m-{qtype}.gguf", qtype)
    got, cfg = _ours(path)
    assert cfg.architecture == "llama" and not cfg.tie_word_embeddings
    # exact: against HF running the very weights the file holds (gguf's numpy dequantizer)
    ref_q = hf_logits(hf_with_quantized_weights(hf_llama, qtype), IDS)
    assert (got - ref_q).abs().max().item() <= 1e-4
    # and close to the unquantized model, within what the quantization costs
    ref = hf_logits(hf_llama, IDS)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel <= {"F32": 1e-5, "F16": 5e-3, "BF16": 6e-2, "Q8_0": 6e-2}.get(qtype, 0.6)


@pytest.mark.parametrize("family,arch,qtype", [("qwen2", "qwen2", "F32"),
                                               ("qwen3", "qwen3", "Q8_0"),
                                               ("smollm2", "llama", "F16")])
def test_other_families_gguf(tmp_path, family, arch, qtype):
    hf = tiny_hf(family, seed=12)
    path = write_gguf(hf, tmp_path / "m.gguf", qtype, arch=arch)
    got, cfg = _ours(path)
    assert cfg.architecture == arch
    assert cfg.tie_word_embeddings == (family == "smollm2")
    assert cfg.attention_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    ref = hf_logits(hf_with_quantized_weights(hf, qtype), IDS)
    assert (got - ref).abs().max().item() <= 1e-4


def test_llama3_rope_freqs_tensor(tmp_path):
    # llama.cpp stores Llama 3.1 rope scaling as a rope_freqs tensor of per-frequency divisors
    hf = tiny_hf("llama3_rope", seed=13)
    from outpace.model_config import ModelConfig
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    plain = rope_inv_freq(ModelConfig(**{**cfg.__dict__, "rope_scaling": None}))
    factors = plain / rope_inv_freq(cfg)
    # every regime is exercised: kept (1), stretched (8) and the blended band between
    assert factors.min() == 1.0 and factors.max() > 7.99 and ((factors > 1) & (factors < 7)).any()
    path = write_gguf(hf, tmp_path / "m.gguf", "F32", rope_freqs=factors)
    got, gcfg = _ours(path)
    assert gcfg.rope_scaling["rope_type"] == "freq_factors"
    assert (got - hf_logits(hf, IDS)).abs().max().item() <= 1e-4


def test_reader_agrees_with_gguf_reader(hf_llama, tmp_path):
    path = write_gguf(hf_llama, tmp_path / "m.gguf", "Q8_0")
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        v = ours.metadata[key]
        assert (v.tolist() if hasattr(v, "tolist") else v) == pytest.approx(field.contents())
    assert len(ours.tensors) == len(ref.tensors)
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert (mine.offset, mine.nbytes, mine.type_name) == (t.data_offset, t.n_bytes,
                                                              t.tensor_type.name)
        ref_bytes = np.asarray(t.data).view(np.uint8).reshape(-1)
        assert np.array_equal(ours.raw(mine).reshape(-1), ref_bytes)


ALL_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]


def _random_blocks(qtype, rows=6, cols=2 * 256, seed=0):
    qt = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(seed)
    if qtype in ("F32", "Q8_0", "Q4_0", "Q4_1", "BF16", "F16"):
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qt)
    # no K-quant quantizer in gguf-py: random blocks with finite f16 scales (Q4_K / Q5_K: d
    # and dmin first; Q6_K: d last)
    raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, size)
    if qtype == "Q6_K":
        blocks[..., -2:] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    else:
        blocks[..., :4] = np.frombuffer(np.float16([0.01, -0.002]).tobytes(), np.uint8)
    return raw


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_dequantize_matches_gguf_reference(qtype):
    rows, cols = 6, 2 * 256
    raw = _random_blocks(qtype).view(np.uint8).reshape(rows, -1)
    qt = gguf.GGMLQuantizationType[qtype]
    ref = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qt)))
    got = dequantize(raw, qtype, (rows, cols))
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert torch.isfinite(ref).all() and torch.equal(got, ref.reshape(rows, cols))


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_a_tensor_parallel_ranks_part_dequantized_alone(qtype):
    """QuantizedTensor.part: rows dequantized from their own blocks, columns cut from the whole
    tensor; the same bits as the whole tensor's slice."""
    from outpace.models.loader.gguf_quants import QuantizedTensor
    raw = _random_blocks(qtype, seed=4).view(np.uint8).reshape(6, -1)
    whole = dequantize(raw, qtype, (6, 512))
    t = QuantizedTensor(raw, qtype, (6, 512))
    for dim, start, length in ((0, 0, 2), (0, 2, 4), (0, 5, 1), (1, 256, 256), (1, 0, 32)):
        assert torch.equal(t.part(dim, start, length), whole.narrow(dim, start, length))


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_dequantize_into_a_weight_gives_the_same_bits(qtype):
    # the loader dequantizes straight into the model's parameters: the same values as a
    # fresh tensor, on random blocks of every type, the whole tensor written
    for seed in range(3):
        raw = _random_blocks(qtype, seed=seed).view(np.uint8).reshape(6, -1)
        fresh = dequantize(raw, qtype, (6, 512))
        out = torch.full((6, 512), float("nan"))
        assert dequantize(raw, qtype, (6, 512), out=out) is out
        assert torch.isfinite(fresh).all() and torch.equal(out, fresh)
    with pytest.raises(ValueError, match="contiguous float32"):
        dequantize(raw, qtype, (6, 512), out=torch.empty(512, 6).t())


@pytest.mark.parametrize("qtype,dtype", [("Q4_1", torch.float32), ("Q8_0", torch.float32),
                                         ("F16", torch.float32), ("Q4_0", torch.bfloat16)])
def test_gguf_load_equals_the_copy_of_dequantized_tensors(hf_llama, tmp_path, qtype, dtype):
    # every parameter of a GGUF load bit-identical to loading the dequantized tensors (the
    # loader's way before it wrote into the parameters), float32 or rounded to bf16
    from outpace.models.loader.gguf import GGUFFile, config_from_gguf, iter_gguf_weights
    from outpace.models.registry import model_class
    path = write_gguf(hf_llama, tmp_path / "m.gguf", qtype)
    model, cfg, g = load_gguf(path, dtype=dtype, quiet=True)
    ref = model_class(cfg.architecture)(cfg, dtype=dtype, device="cpu")
    g2 = GGUFFile(path)
    ref.load_weights([(n, t.dequantize()) for n, t in
                      iter_gguf_weights(g2, config_from_gguf(g2), quiet=True)])
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for name in got:
        assert torch.equal(got[name], want[name]), name


def test_string_arrays_read_when_asked(hf_llama, tmp_path):
    words = ["a", "\u00fc\u00df", "", "\U0001f600 x", "merge me"] * 7
    path = write_gguf(hf_llama, tmp_path / "m.gguf", "F32",
                      extra_kv={"tokenizer.ggml.tokens": words, "test.after": "still read"})
    g = GGUFFile(path)
    tokens = g.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == len(words) and tokens[3] == words[3] and list(tokens) == words
    assert g.metadata["test.after"] == "still read"  # the parse went past the array right


# ---- errors ----------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no model at"):
        locate(tmp_path / "nope.gguf")


def test_truncated_gguf(hf_llama, tmp_path):
    path = write_gguf(hf_llama, tmp_path / "m.gguf", "Q8_0")
    data = path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 2000, 30, 10, 0):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=f"cut{cut}.gguf"):
            load_gguf(bad, quiet=True)


def test_corrupt_gguf(hf_llama, tmp_path):
    path = write_gguf(hf_llama, tmp_path / "m.gguf", "F32")
    data = bytearray(path.read_bytes())
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(bytes(data[:24]) + b"\xff" * 200 + bytes(data[224:]))
    with pytest.raises(ModelLoadError, match="garbage.gguf"):
        load_gguf(bad, quiet=True)
    notgguf = tmp_path / "x.gguf"
    notgguf.write_bytes(b"PK\x03\x04" + bytes(data[4:]))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model_config(notgguf)


def test_unsupported_architecture(hf_llama, tmp_path):
    path = write_gguf(hf_llama, tmp_path / "m.gguf", "F32", arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*llama"):
        load_gguf(path, quiet=True)


def test_unsupported_tensor_type(hf_llama, tmp_path):
    q5 = gguf.GGMLQuantizationType.Q5_0
    path = write_gguf(hf_llama, tmp_path / "m.gguf", "F32",
                      override_qtype={"blk.1.ffn_up.weight": q5})
    with pytest.raises(UnsupportedModelError, match="Q5_0"):
        load_gguf(path, quiet=True)


def test_gguf_without_tokenizer_metadata(hf_llama, tmp_path, monkeypatch):
    from outpace.tokenizer import Tokenizer
    monkeypatch.setenv("OUTPACE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(hf_llama, tmp_path / "m.gguf", "F32")
    with pytest.raises(ModelLoadError, match="tokenizer"):
        Tokenizer.from_gguf(path)


def test_missing_tensor(hf_llama, tmp_path):
    path = write_gguf(hf_llama, tmp_path / "m.gguf", "F32",
                      skip=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_gguf(path, quiet=True)


@pytest.mark.parametrize("metadata,word", [
    ({"add_head_count": 0}, "head_count"),
    ({"add_rope_freq_base": 0.0}, "rope_theta"),
    ({"add_block_count": 10 ** 6}, "num_hidden_layers"),
    ({"add_context_length": 2 * 10 ** 7}, "max_position_embeddings"),
    ({"add_layer_norm_rms_eps": float("nan")}, "rms_norm_eps"),
])
def test_lying_metadata_is_an_error_that_names_the_field(hf_llama, tmp_path, metadata, word):
    """Checked with Python numbers before any tensor is read or any model built."""
    import time
    path = write_gguf(hf_llama, tmp_path / "m.gguf", "F32", metadata=metadata)
    t = time.perf_counter()
    with pytest.raises(ModelLoadError, match=word):
        load_gguf(path, quiet=True)
    assert time.perf_counter() - t < 2.0


@pytest.mark.parametrize("metadata,extra,msg", [
    ({"add_context_length": lambda w: w.add_string("llama.context_length", "abc")}, None,
     "GGUF metadata llama.context_length is 'abc', not an integer"),
    ({"add_eos_token_id": lambda w: w.add_float32("tokenizer.ggml.eos_token_id", 1.5)}, None,
     "tokenizer.ggml.eos_token_id is 1.5, not an integer"),
    ({"add_rope_freq_base": lambda w: w.add_array("llama.rope.freq_base", [1.0])}, None,
     "llama.rope.freq_base is .*, not a number"),
    (None, {"llama.rope.scaling.type": "linear"}, "lacks llama.rope.scaling.factor"),
    (None, {"llama.rope.scaling.type": 3}, "llama.rope.scaling.type is 3, not a string"),
    ({"add_feed_forward_length": 1 << 18}, None,
     r"tensor model.layers.0.mlp.gate_proj.weight has shape \(96, 64\), but the model config "
     r"\(intermediate_size=262144, hidden_size=64\) expects \(262144, 64\)"),
])
def test_metadata_of_the_wrong_type_or_size_names_the_key(hf_llama, tmp_path, metadata, extra,
                                                          msg):
    """A value of another GGUF type, or one that the tensors contradict, is an error naming it,
    raised before the model is allocated."""
    path = write_gguf(hf_llama, tmp_path / "m.gguf", "F32", metadata=metadata, extra_kv=extra)
    with pytest.raises(ModelLoadError, match=msg):
        load_gguf(path, quiet=True)


def test_tensor_rows_of_partial_quant_blocks(hf_llama, tmp_path):
    """A Q8_0 tensor whose rows are not whole 32-value blocks can't be addressed: an error."""
    import struct
    path = write_gguf(hf_llama, tmp_path / "m.gguf", "Q8_0")
    name = b"blk.0.ffn_up.weight"

    def forge(data):
        at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
        struct.pack_into("<Q", data, at + 4, 33)  # ne[0]: the row length
    _patch_header(path, forge)
    with pytest.raises(ModelLoadError, match=r"blk.0.ffn_up.weight has shape .*whole 32-value "
                                             r"blocks"):
        GGUFFile(path)


def _patch_header(path, edit):
    data = bytearray(path.read_bytes())
    edit(data)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("align", [0, 3])
def test_bad_alignment(hf_llama, tmp_path, align):
    path = write_gguf(hf_llama, tmp_path / "m.gguf", "F32")
    key = b"general.alignment"
    assert key not in path.read_bytes()
    import struct

    def add_key(data):  # one more metadata entry, right after the count fields
        n_kv_at = 4 + 4 + 8  # magic, version, n_tensors
        n_kv = struct.unpack_from("<Q", data, n_kv_at)[0]
        struct.pack_into("<Q", data, n_kv_at, n_kv + 1)
        entry = struct.pack("<Q", len(key)) + key + struct.pack("<II", 4, align)  # uint32
        data[n_kv_at + 8:n_kv_at + 8] = entry
    _patch_header(path, add_key)
    with pytest.raises(ModelLoadError, match="general.alignment"):
        GGUFFile(path)


def test_tensor_dims_whose_product_overflows_int64(hf_llama, tmp_path):
    """Dims of 2^40 x 2^40 elements multiply past int64: the size check must not wrap around
    (it then passed, and a 1 TB allocation followed)."""
    import struct
    path = write_gguf(hf_llama, tmp_path / "m.gguf", "F32")
    name = b"token_embd.weight"

    def forge(data):
        at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
        assert struct.unpack_from("<I", data, at)[0] == 2
        struct.pack_into("<QQ", data, at + 4, 1 << 40, 1 << 40)
    _patch_header(path, forge)
    with pytest.raises(ModelLoadError, match="truncated"):
        GGUFFile(path)
