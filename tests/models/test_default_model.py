"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF) against transformers' own GGUF loading."""

import time

import pytest
import torch

from outpace.models.loader import load_model
from outpace.runner_config import RunnerConfig
from outpace.tokenizer import Tokenizer
from tests.models.helpers import PagedRunner

pytestmark = pytest.mark.slow

CHAT = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def fresh_cache(default_gguf, tmp_path_factory):
    """An empty OUTPACE_CACHE for this module, so the tokenizer is built from the GGUF once."""
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("outpace-cache")
    mp.setenv("OUTPACE_CACHE", str(cache))
    yield cache
    mp.undo()


@pytest.fixture(scope="module")
def ours(default_gguf, fresh_cache):
    t0 = time.perf_counter()
    model, cfg, tok = load_model(str(default_gguf), RunnerConfig(), quiet=True)
    print(f"\nload_model (cold tokenizer cache): {time.perf_counter() - t0:.2f} s")
    return model, cfg, tok


def test_config_from_metadata(ours):
    _, cfg, tok = ours
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0
    assert 2 in tok.eos_token_ids  # <|im_end|>


def test_tokenizer_cache_matches_transformers(ours, default_gguf, fresh_cache):
    direct = ours[2]  # built by transformers from the GGUF metadata (the cache was empty)
    saved = list((fresh_cache / "tokenizers").iterdir())
    assert len(saved) == 1
    t0 = time.perf_counter()
    cached = Tokenizer.from_gguf(default_gguf, direct.eos_token_ids)
    assert time.perf_counter() - t0 < 3.0  # the cache is what makes this fast (~0.3 s)
    texts = ["Hello world!", "  leading spaces\tand tabs\n\nnew lines",
             "naïve café 日本語 🚀",
             "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x**2  # code"]
    for t in texts:
        assert cached.encode(t) == direct.encode(t) == direct.hf(t)["input_ids"]
        assert cached.decode(direct.encode(t)) == direct.decode(direct.encode(t))
    convs = [CHAT, CHAT[1:], CHAT + [{"role": "assistant", "content": "Paris."},
                                     {"role": "user", "content": "And of Italy?"}]]
    for msgs in convs:
        ref = direct.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert direct.apply_chat_template(msgs) == ref == cached.apply_chat_template(msgs)
    assert cached.eos_token_ids == direct.eos_token_ids and cached.vocab_size == direct.vocab_size


def _prompt(tok):
    return tok.encode(tok.apply_chat_template(CHAT))


def test_logits_match_transformers(ours, hf_default_model):
    model, _, tok = ours
    ids = _prompt(tok)
    got = PagedRunner(model, num_seqs=1, max_len=len(ids)).step({0: ids})[0]
    with torch.inference_mode():
        ref = hf_default_model(torch.tensor([ids])).logits[0].float()
    assert (got - ref).abs().max().item() <= 1e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_decode_matches_transformers_generate(ours, hf_default_model):
    model, _, tok = ours
    ids, n = _prompt(tok), 12
    runner = PagedRunner(model, num_seqs=1, max_len=len(ids) + n)
    logits = runner.step({0: ids})[0]
    out = [int(logits[-1].argmax())]
    for _ in range(n - 1):
        out.append(int(runner.step({0: out[-1:]})[0][-1].argmax()))
    with torch.inference_mode():
        ref = hf_default_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert out == ref, (tok.decode(out), tok.decode(ref))


def test_greedy_output_equals_transformers_generate(loaded_default, hf_default_model):
    """5 chat prompts x 32 tokens, batched through the engine, == HF generate one by one."""
    from outpace import SamplingParams
    from tests.engine_helpers import chat_ids, make_engine, run_batch
    eng = make_engine(loaded_default)
    prompts = chat_ids(eng.tokenizer, ["What is the capital of France?",
                                       "Write a haiku about the sea.",
                                       "Explain recursion to a child in two sentences.",
                                       "List three prime numbers.",
                                       "Translate 'good morning' into Spanish."])
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    got = run_batch(eng, prompts, params)
    for p, ours in zip(prompts, got):
        with torch.inference_mode():
            ref = hf_default_model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False,
                                            eos_token_id=None, pad_token_id=0)[0, len(p):]
        assert ours == ref.tolist(), eng.tokenizer.decode(ours)
