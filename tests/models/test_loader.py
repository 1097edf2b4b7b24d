"""HF-folder loading and the load_model facade: the happy path and every user error."""

import json
import shutil

import pytest
import torch

from outpace.errors import ModelLoadError, UnsupportedModelError
from outpace.model_config import ModelConfig
from outpace.models.loader import load_model, load_model_config, locate
from outpace.models.loader.safetensors import load_hf_folder
from outpace.models.registry import architecture_of
from outpace.runner_config import RunnerConfig
from tests.models.helpers import PagedRunner, hf_logits, tiny_hf


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    hf = tiny_hf("qwen2", seed=21)
    folder = tmp_path_factory.mktemp("qwen2")
    hf.save_pretrained(folder)
    return hf, folder


def _copy(folder, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(folder, dst)
    return dst


def test_architecture_of():
    assert architecture_of({"model_type": "llama"}) == "llama"
    assert architecture_of({"architectures": ["Qwen3ForCausalLM"]}) == "qwen3"
    assert architecture_of({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
                           ) == "mistral"
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*llama, mistral, qwen2, qwen3"):
        architecture_of({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedModelError, match="gelu"):
        architecture_of({"model_type": "llama", "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        architecture_of({"model_type": "qwen2", "rope_scaling": {"rope_type": "yarn",
                                                                 "factor": 4.0}})


def test_sharded_folder_and_bf16(hf_folder, tmp_path):
    hf, _ = hf_folder
    folder = tmp_path / "sharded"
    hf.save_pretrained(folder, max_shard_size="40KB")  # several shards + index
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 2
    ids = list(range(3, 40, 2))
    model, cfg = load_hf_folder(folder, quiet=True)
    got = PagedRunner(model, num_seqs=1).step({0: ids})[0]
    assert (got - hf_logits(hf, ids)).abs().max().item() <= 1e-4
    bf16, _ = load_hf_folder(folder, dtype=torch.bfloat16, quiet=True)
    assert bf16.embed_weight.dtype == torch.bfloat16
    got16 = PagedRunner(bf16, num_seqs=1).step({0: ids})[0]
    assert got16.dtype == torch.float32
    assert (got16 - got).abs().max().item() < 0.1 * got.abs().max().item()


def test_load_model_facade_without_tokenizer_files(hf_folder):
    _, folder = hf_folder  # no tokenizer in a bare save_pretrained: a clear error, not a crash
    assert load_model_config(folder).architecture == "qwen2"
    with pytest.raises(ModelLoadError, match="tokenizer"):
        load_model(str(folder), RunnerConfig(), quiet=True)


def test_missing_path_and_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no model at .*smollm2-135m"):
        locate(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        locate(tmp_path / "empty")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_hf_folder(tmp_path / "empty", quiet=True)


def test_folder_without_weights(hf_folder, tmp_path):
    folder = _copy(hf_folder[1], tmp_path)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors.*pytorch_model.bin"):
        load_hf_folder(folder, quiet=True)


def test_missing_shard(hf_folder, tmp_path):
    folder = tmp_path / "sharded"
    hf_folder[0].save_pretrained(folder, max_shard_size="40KB")
    victim = sorted(folder.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=victim.name):
        load_hf_folder(folder, quiet=True)


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors(hf_folder, tmp_path, how):
    folder = _copy(hf_folder[1], tmp_path)
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) * 2 // 3], "garbage": b"\x07" * 500,
                   "empty": b""}[how])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_hf_folder(folder, quiet=True)


def _copy_with_config(hf_folder, tmp_path):
    """A copy of the test folder -> (folder, its config.json path, the config as a dict)."""
    folder = _copy(hf_folder[1], tmp_path)
    cfg = folder / "config.json"
    return folder, cfg, json.loads(cfg.read_text())


def test_bad_config(hf_folder, tmp_path):
    folder, cfg, d = _copy_with_config(hf_folder, tmp_path)
    cfg.write_text(json.dumps({**d, "model_type": "gemma", "architectures": ["GemmaForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="gemma"):
        load_hf_folder(folder, quiet=True)
    cfg.write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_hf_folder(folder, quiet=True)
    cfg.write_text(json.dumps({k: v for k, v in d.items() if k != "hidden_size"}))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load_hf_folder(folder, quiet=True)


def test_weights_do_not_match_config(hf_folder, tmp_path):
    folder, cfg, d = _copy_with_config(hf_folder, tmp_path)
    cfg.write_text(json.dumps({**d, "intermediate_size": d["intermediate_size"] * 2}))
    with pytest.raises(ModelLoadError, match=r"mlp.*shape \(96, 64\), but the model config "
                                             r"\(intermediate_size=192, hidden_size=64\)"):
        load_hf_folder(folder, quiet=True)
    cfg.write_text(json.dumps({**d, "num_hidden_layers": d["num_hidden_layers"] + 1}))
    with pytest.raises(ModelLoadError, match="lacks .*model.layers.3"):
        load_hf_folder(folder, quiet=True)


def test_load_weights_fuses_and_reports_unused(hf_folder):
    hf, folder = hf_folder
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    from outpace.models.llama import LlamaForCausalLM
    model = LlamaForCausalLM(cfg)
    sd = hf.state_dict()
    unused = model.load_weights(list(sd.items()) + [("model.extra.weight", torch.zeros(1))])
    assert unused == ["model.extra.weight"]
    a = model.layers[1].self_attn
    q, k, v = (sd[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(a.qkv_weight, torch.cat([q, k, v]))
    assert torch.equal(a.qkv_bias, torch.cat([sd[f"model.layers.1.self_attn.{n}_proj.bias"]
                                              for n in "qkv"]))
    assert a.o_bias is None  # Qwen2: no bias on o_proj


@pytest.mark.parametrize("change,word", [
    ({"num_hidden_layers": 10 ** 6}, "num_hidden_layers"),
    ({"vocab_size": -1}, "vocab_size"),
    ({"vocab_size": "abc"}, "vocab_size"),
    ({"vocab_size": 10 ** 12}, "vocab_size"),
    ({"hidden_size": 10 ** 6}, "hidden_size"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"max_position_embeddings": 2 * 10 ** 7}, "max_position_embeddings"),
    ({"rope_theta": 0, "rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     "rope_theta"),
    ({"rope_scaling": {"rope_type": "llama3"}}, "factor"),
    ({"rope_scaling": "linear"}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
])
def test_lying_config_is_an_error_that_names_the_field(hf_folder, tmp_path, change, word):
    """Every config value is checked with Python numbers before anything is built from it:
    an error that names the field, fast, instead of a huge allocation or a broken model."""
    import time
    folder, cfg, d = _copy_with_config(hf_folder, tmp_path)
    cfg.write_text(json.dumps({**d, **change}))
    t = time.perf_counter()
    with pytest.raises((ModelLoadError, UnsupportedModelError), match=word):
        load_hf_folder(folder, quiet=True)
    assert time.perf_counter() - t < 2.0


def test_config_nested_too_deep(hf_folder, tmp_path):
    folder, cfg, d = _copy_with_config(hf_folder, tmp_path)
    cfg.write_text('{"a": ' * 100000 + "1" + "}" * 100000)
    with pytest.raises(ModelLoadError, match="config.json"):
        load_hf_folder(folder, quiet=True)


def test_rope_tables_cover_only_the_positions_the_engine_reaches(hf_folder, tmp_path):
    """A model may claim 2^24 positions (tables of gigabytes, built for seconds): the tables
    cover max_model_len, or what the KV pool can hold, with the same values."""
    import time

    from outpace.engine.engine import LLMEngine
    from outpace.models.rotary import POSITION_MARGIN
    from tests.models.helpers import word_tokenizer
    hf, _ = hf_folder
    folder, cfg, d = _copy_with_config(hf_folder, tmp_path)
    cfg.write_text(json.dumps({**d, "max_position_embeddings": 1 << 24}))
    word_tokenizer(folder)
    head_dim = d["hidden_size"] // d["num_attention_heads"]
    t = time.perf_counter()
    model, mc = load_hf_folder(folder, quiet=True, max_positions=64)
    assert time.perf_counter() - t < 2.0
    assert mc.max_position_embeddings == 1 << 24 and model.rotary.max_positions == 64
    assert model.rotary.cos.shape == model.rotary.sin.shape == (64 + POSITION_MARGIN, head_dim)
    full, _ = load_hf_folder(hf_folder[1], quiet=True)  # the tiny model's own 128 positions
    assert full.rotary.cos.shape[0] == 128 + POSITION_MARGIN
    assert torch.equal(full.rotary.cos[:64 + POSITION_MARGIN], model.rotary.cos)
    assert torch.equal(full.rotary.sin[:64 + POSITION_MARGIN], model.rotary.sin)

    def rope_rows(**kw):
        t = time.perf_counter()
        eng = LLMEngine.from_args(str(folder), device="cpu", quiet=True, **kw)
        assert time.perf_counter() - t < 5.0
        return eng.runner.model.rotary.cos.shape[0] - POSITION_MARGIN, eng.max_model_len
    assert rope_rows(max_model_len=100, num_kv_blocks=64) == (100, 100)
    # no max_model_len: the context is what the pool holds (8 blocks of 16), and so the tables
    assert rope_rows(num_kv_blocks=9) == (128, 128)
