"""Tokenizer wrapper: a tiny word-level tokenizer saved as an HF folder (fast, no real model)."""

import pytest
import torch

from outpace.errors import InvalidRequestError, ModelLoadError
from outpace.tokenizer import Tokenizer

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'tool' %}"
            "{{ raise_exception('tools are not supported') }}{% endif %}"
            "<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>", "hello", "world", "user",
             "assistant", "system", "hi", "<|endoftext|>"]
    raw = RawTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>",
                                 eos_token="<|im_end|>",
                                 additional_special_tokens=["<|im_start|>", "<|endoftext|>"])
    hf.chat_template = TEMPLATE
    d = tmp_path_factory.mktemp("tok")
    hf.save_pretrained(d)
    return d


def test_encode_decode_and_eos(folder):
    tok = Tokenizer.from_folder(folder, model_eos_ids=(10, 2))
    assert tok.eos_token_ids == (2, 10)  # tokenizer's first, then the model's, no duplicates
    ids = tok.encode("hello world hello")
    assert ids == [4, 5, 4]
    assert tok.decode(ids + [2]) == "hello world hello"  # specials skipped by default
    assert "<|im_end|>" in tok.decode(ids + [2], skip_special_tokens=False)
    assert tok.decode(torch.tensor(ids)) == "hello world hello"
    assert Tokenizer.load(folder).encode("world") == [5]
    assert tok.convert_ids_to_tokens([4, 5]) == ["hello", "world"]
    assert tok.vocab_size == 11
    assert tok.hf.eos_token == "<|im_end|>"


def test_chat_template(folder):
    tok = Tokenizer.from_folder(folder)
    msgs = [{"role": "system", "content": "hi"},
            {"role": "user", "content": [{"type": "text", "text": "hello "},
                                         {"type": "text", "text": "world"}]}]
    text = tok.apply_chat_template(msgs)
    assert text == ("<|im_start|>system hi<|im_end|> <|im_start|>user hello world<|im_end|> "
                    "<|im_start|>assistant ")
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant ")


@pytest.mark.parametrize("messages,match", [
    ([], "non-empty"),
    ("hello", "non-empty"),
    ([{"content": "x"}], "role"),
    ([{"role": "wizard", "content": "x"}], "wizard"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "text parts"),
    ([{"role": "tool", "content": "x"}], "tools are not supported"),  # the template raises
])
def test_bad_messages(folder, messages, match):
    tok = Tokenizer.from_folder(folder)
    with pytest.raises(InvalidRequestError, match=match):
        tok.apply_chat_template(messages)


def test_no_chat_template(folder, tmp_path):
    tok = Tokenizer.from_folder(folder)
    tok.hf.chat_template = None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_folder_without_tokenizer(tmp_path):
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match="tokenizer"):
        Tokenizer.from_folder(tmp_path)


def _punct_tokenizer(clean_up: bool):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "<s>", "</s>", "hello", "world", ",", ".", "'s", "n't", "it", "is", "!",
             "?", "a", "test"]
    raw = RawTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", clean_up_tokenization_spaces=clean_up)


@pytest.mark.parametrize("clean_up", [False, True])
def test_decode_matches_transformers(clean_up):
    """The fast decode (the tokenizers backend, skipping transformers' Python wrapper) is used
    only where it gives transformers' text: with the clean-up of spaces before punctuation
    asked for (a word-level model, which transformers does clean up) decode keeps HF's."""
    hf = _punct_tokenizer(clean_up)
    tok = Tokenizer(hf)
    assert (tok._backend_decode is None) == clean_up
    ids = hf.encode("hello , world . it is a test !", add_special_tokens=False)
    for skip in (True, False):
        assert tok.decode(ids + [2], skip) == hf.decode(ids + [2], skip_special_tokens=skip)
    assert tok.decode(ids) == ("hello, world. it is a test!" if clean_up
                               else "hello , world . it is a test !")


def test_default_tokenizer_decodes_like_transformers(loaded_default):
    """SmolLM2's BPE tokenizer: byte-level pieces, specials, partial UTF-8 sequences."""
    import random
    tok = loaded_default[2]
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 9))]
        for skip in (True, False):
            assert tok.decode(ids, skip) == tok.hf.decode(ids, skip_special_tokens=skip)


def _random_ids(rng, tok, n):
    """Ids biased to SmolLM2's special (< 20) and single-byte (< 300) tokens: partial UTF-8
    characters and skipped specials."""
    def one():
        r = rng.random()
        return (rng.randrange(0, 20) if r < 0.1 else rng.randrange(20, 300) if r < 0.4
                else rng.randrange(tok.vocab_size))
    return [one() for _ in range(n)]


def _detokenize(tok, prompt, out, skip, stream: bool, stop=None):
    from outpace.engine.detokenize import IncrementalDetokenizer
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, stop=stop)
    if not stream:
        d._stream = None
    for t in out:
        if d.add_token(t) is not None:
            break
    return d


def test_decode_stream_gives_the_per_token_text(loaded_default):
    """IncrementalDetokenizer through the tokenizers library's DecodeStream (one call a token)
    gives exactly the Python per-token algorithm's text: random prompts and outputs full of
    byte pieces and specials, both skip settings, and stop strings cut at the same place. A
    context that ends inside a character keeps the Python algorithm (the stream would emit
    the prompt's completed character)."""
    import random
    tok = loaded_default[2]
    rng = random.Random(3)
    streamed = 0
    for _ in range(400):
        prompt = _random_ids(rng, tok, rng.randrange(1, 8))
        out = _random_ids(rng, tok, rng.randrange(1, 30))
        for skip in (True, False):
            want = _detokenize(tok, prompt, out, skip, stream=False)
            got = _detokenize(tok, prompt, out, skip, stream=True)
            streamed += got._stream is not None
            assert got.text == want.text
            if len(want.text) > 4:  # a stop string in the middle of the text
                stop = [want.text[len(want.text) // 2:len(want.text) // 2 + 2]]
                w = _detokenize(tok, prompt, out, skip, stream=False, stop=stop)
                g = _detokenize(tok, prompt, out, skip, stream=True, stop=stop)
                assert (g.text, g.stopped_by) == (w.text, w.stopped_by)
    assert streamed > 400  # the contexts that decode to whole characters
    partial = next(i for i in range(20, 300) if "\ufffd" in tok.decode([i]))
    assert tok.decode_stream([5, partial]) is None


def test_detokenizer_survives_a_failing_stream(loaded_default):
    """Should the stream raise mid-output, the text is rebuilt by the Python algorithm and goes
    on there: the same text, and a stop string in the part after the failure still ends it."""
    tok = loaded_default[2]
    prompt = tok.encode("The answer:", add_special_tokens=False)
    out = tok.encode(" one two three four five six", add_special_tokens=False)
    want = _detokenize(tok, prompt, out, True, stream=False)
    from outpace.engine.detokenize import IncrementalDetokenizer
    for stop in (None, [" five"]):
        d = IncrementalDetokenizer(tok, prompt, stop=stop)
        assert d._stream is not None
        inner, calls = d._stream, []

        def failing(t, inner=inner, calls=calls):
            calls.append(t)
            if len(calls) == 3:
                raise RuntimeError("stream failed")
            return inner(t)
        d._stream = failing
        stopped = None
        for t in out:
            stopped = d.add_token(t)
            if stopped is not None:
                break
        assert d._stream is None and len(calls) == 3
        if stop is None:
            assert d.text == want.text == " one two three four five six"
        else:
            assert (stopped, d.text) == (" five", " one two three four")


def test_no_stream_where_transformers_cleans_up():
    assert Tokenizer(_punct_tokenizer(True)).decode_stream([4, 5]) is None
    assert Tokenizer(_punct_tokenizer(False)).decode_stream([4, 5]) is not None


def test_vocab_size_counts_the_added_tokens(tmp_path):
    """vocab_size is every id the tokenizer knows, tokens added past the base vocabulary too
    (len(tokenizer), not transformers' vocab_size): what /detokenize and prompts of ids are
    checked against."""
    from transformers import AutoTokenizer
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast
    raw = RawTokenizer(WordLevel({"<unk>": 0, "hello": 1, "</s>": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>")
    hf.add_tokens(["<tool>"], special_tokens=True)
    hf.save_pretrained(tmp_path)
    tok = Tokenizer.from_folder(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).vocab_size == 3
    assert tok.vocab_size == 4 and tok.decode([3], skip_special_tokens=False) == "<tool>"


def test_no_length_bound_with_an_unknown_token_fallback(folder):
    """A word-level vocabulary makes any unknown word, however long, one <unk>: no bound."""
    tok = Tokenizer.from_folder(folder)
    assert len(tok.encode("x" * 5000)) == 1
    assert tok.fewest_tokens("x" * 5000) == 0


def test_fewest_tokens_is_a_lower_bound(loaded_default):
    """The default (byte-level) tokenizer: fewest_tokens never exceeds the real count, on texts
    of its longest tokens, whitespace and symbol runs, special tokens' text, combining marks and
    multi-byte characters; a 3.9 MB text is past any context without being tokenized."""
    tok = loaded_default[2]
    vocab = tok.hf.get_vocab()
    longest = sorted(vocab, key=len)[-40:]  # the longest tokens' texts, back to back
    texts = ["".join(tok.decode([vocab[t]], skip_special_tokens=False) for t in longest) * 20,
             tok.decode([vocab[max(vocab, key=len)]]) * 60, " " * 5000, "#" * 8000,
             "\n\t " * 2000, "<|im_start|>user\n" * 300, "e\u0301a\u0308" * 1500,
             "héllo wörld, 你好世界 🙂 " * 300, "".join(chr(i) for i in range(32, 3000))]
    for text in texts:
        n = len(tok.encode(text))
        assert 0 < tok.fewest_tokens(text) <= n, (text[:40], n)
    assert tok.fewest_tokens("a" * 3_900_000) > 8192
    # its premise: no token decodes to more characters than the bound's longest token
    longest_text = max(len(tok.decode([i], skip_special_tokens=False))
                       for i in range(len(vocab)))
    assert longest_text == tok._max_token_chars


def test_engine_refuses_a_huge_text_before_tokenizing(loaded_default):
    """LLMEngine.add_request: a text past the context by its length alone is refused by the
    length check (its message counts characters; the check after tokenizing counts tokens)."""
    from tests.engine_helpers import make_engine
    eng = make_engine(loaded_default, num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="3900000 characters, so at least"):
        eng.add_request("huge", "a" * 3_900_000)
    assert not eng.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match=r"the prompt has \d+ tokens"):
        eng.add_request("long", "hello " * 1100)  # past the pool's context, not its length


class _EncodesOtherwise:
    """A transformers tokenizer whose encode gives more than its backend's (as one whose
    Python side adds a token would)."""

    def __init__(self, hf):
        self._hf, self._tokenizer = hf, hf._tokenizer

    def __getattr__(self, name):
        return getattr(self._hf, name)

    def __len__(self):
        return len(self._hf)

    def encode(self, text, **kw):
        return self._hf.encode(text, **kw) + [0]


def test_encode_uses_the_backend_only_where_it_gives_transformers_ids():
    hf = _punct_tokenizer(False)
    tok = Tokenizer(hf)
    assert tok._backend_encoder is not None
    for text in ("hello , world .", "", "it is n't a test !", "unknown words here"):
        for special in (True, False):
            assert tok.encode(text, special) == hf.encode(text, add_special_tokens=special)
    other = Tokenizer(_EncodesOtherwise(hf))
    assert other._backend_encoder is None
    assert other.encode("hello world") == hf.encode("hello world") + [0]


def test_default_tokenizer_encodes_like_transformers(loaded_default):
    """SmolLM2's BPE tokenizer through the backend's encode: random text of its own pieces,
    special-token text, spaces, newlines and non-ASCII; and a rendered chat."""
    import random
    tok = loaded_default[2]
    assert tok._backend_encoder is not None
    rng = random.Random(1)
    alphabet = list("abc XYZ  \n\t.,;'\"!?0123") + ["\u00e9", "\u4e2d", "\U0001f600", "\u0301"]
    specials = tok._special_token_texts()
    for _ in range(200):
        parts = [rng.choice(alphabet) for _ in range(rng.randrange(0, 40))]
        if rng.random() < 0.3:
            parts.insert(rng.randrange(len(parts) + 1), rng.choice(specials))
        if rng.random() < 0.3:  # the vocabulary's own pieces, decoded
            parts.append(tok.decode([rng.randrange(tok.vocab_size) for _ in range(5)], False))
        text = "".join(parts)
        for special in (True, False):
            assert tok.encode(text, special) == tok.hf.encode(text, add_special_tokens=special)
    chat = [{"role": "user", "content": "Write a haiku about <|im_start|> tokens."}]
    prompt = tok.render_chat(chat)
    want = []
    for text, is_content in prompt.pieces:
        want += tok.hf.encode(text, add_special_tokens=False, split_special_tokens=is_content)
    assert tok.encode_chat(prompt) == want
