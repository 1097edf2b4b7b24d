"""Tokenizer: a thin wrapper over a transformers tokenizer (HF folder or GGUF metadata).

Building a tokenizer from GGUF metadata takes transformers seconds (it converts 49k tokens and
merges to a fast tokenizer); loading the saved result is over ten times faster. So the first
load of a GGUF saves the converted tokenizer under <cache>/tokenizers/<key>, keyed by the hash
of the GGUF's metadata section (which holds the vocabulary and chat template) and the
transformers version.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from outpace.chat_template import ChatPrompt, SpecialText, split_rendering
from outpace.errors import ConfigError, InvalidRequestError, ModelLoadError

CHAT_ROLES = ("system", "user", "assistant", "tool")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model",
                    "tokenizer.tiktoken")


def _flatten_content(content, i: int) -> str:
    """OpenAI content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise InvalidRequestError(
        f"messages[{i}].content must be a string or a list of text parts; images and other "
        "content types are not supported")


# A normalizer may compose characters (NFC: a letter and its combining marks into one), so a
# text can be longer than the token strings it becomes; no composition takes more than this
# many characters into one.
_NORMALIZE_SHRINK = 4


def _max_token_chars(hf) -> Optional[int]:
    """The longest token string of the vocabulary (special tokens included), or None where a
    token may stand for more text than its string spells (an unknown-token fallback: a run of
    unknown characters, a whole unknown word).

    A text's tokens, spelled out, cover the text (after normalization): in a byte-level
    vocabulary a token's string has one character per byte, at least as many as the text it
    decodes to; a SentencePiece piece spells its text (a space as one character, a byte
    fallback as six)."""
    model = getattr(getattr(hf, "_tokenizer", None), "model", None)
    if type(model).__name__ != "BPE" or (getattr(model, "unk_token", None) is not None
                                         and not getattr(model, "byte_fallback", False)):
        return None
    try:
        return max(map(len, hf.get_vocab()), default=0) or None
    except Exception:  # an unusual tokenizer: no bound
        return None


class Tokenizer:
    def __init__(self, hf_tokenizer, model_eos_ids=()):
        self.hf = hf_tokenizer
        self.chat_template: Optional[str] = None  # a user's template in place of the model's
        # Built here, in the loading thread: render_chat runs beside the engine thread's
        # tokenizer calls and must not call into the tokenizer itself.
        specials = self._special_token_texts()
        self._special_text = SpecialText(specials)
        eos = [] if hf_tokenizer.eos_token_id is None else [hf_tokenizer.eos_token_id]
        self.eos_token_ids: tuple = tuple(dict.fromkeys([*eos, *model_eos_ids]))
        self._backend_decode = self._find_backend_decode()
        self._backend_encoder = self._find_backend_encoder(specials)
        self._max_token_chars = _max_token_chars(hf_tokenizer)

    def _find_backend_decode(self):
        """The `tokenizers` library's decode when it gives what transformers' decode gives.

        Detokenization decodes twice per generated token per request, and transformers' decode
        wraps the Rust call in Python (argument conversion, batching checks) that costs more
        than the call itself: at batch 128 detokenization is a large part of a step's host
        time (decisions-log.md, "Detokenization calls the `tokenizers` backend's decode
        directly"). Its only change to the text is the optional clean-up of spaces before
        punctuation; a probe that clean-up would alter tells whether this tokenizer applies it
        (then its decode stays in use)."""
        backend = getattr(self.hf, "_tokenizer", None)  # a fast tokenizer's tokenizers.Tokenizer
        if backend is None or not callable(getattr(backend, "decode", None)):
            return None
        if not getattr(self.hf, "clean_up_tokenization_spaces", False):
            return backend.decode  # transformers' decode is exactly the backend's
        try:  # clean-up asked for: some transformers versions skip it (BPE); find out
            probe = self.hf.encode("Hello , world . It 's a test ! Is n't it ?",
                                   add_special_tokens=False)
            raw = backend.decode(probe, skip_special_tokens=True)
            if self.hf.clean_up_tokenization(raw) == raw:  # the probe can't tell: keep HF's
                return None
            for skip in (True, False):
                if backend.decode(probe, skip_special_tokens=skip) != self.hf.decode(
                        probe, skip_special_tokens=skip):
                    return None  # clean-up applies
        except Exception:  # an unusual tokenizer: keep transformers' decode
            return None
        return backend.decode

    def _find_backend_encoder(self, specials: list):
        """The `tokenizers` library's tokenizer when its encode gives transformers' ids on probe
        texts (special-token text, spaces, newlines, non-ASCII; with and without the special
        tokens added, special-token text split or not); else None (transformers' encode stays).

        Why: every prompt is encoded on the server's tokenizer thread, and transformers' encode
        adds Python around the Rust call (argument handling, an Encoding turned into a dict);
        a wave of requests waits for it in turn before their first token."""
        backend = getattr(self.hf, "_tokenizer", None)
        if (backend is None or not callable(getattr(backend, "encode", None))
                or not hasattr(backend, "encode_special_tokens")):
            return None
        specials = specials[:4]
        probes = ["", "Hello, world!", "  two  spaces\n\nnew lines\tand a tab ",
                  "caf\u00e9 \u4e2d\u6587 \U0001f600 \u00fcber", "x" * 300,
                  "".join(f"{s}text {s}" for s in specials)]
        try:
            for text in probes:
                for special in (True, False):
                    for split in (False, True):
                        want = self.hf.encode(text, add_special_tokens=special,
                                              split_special_tokens=split)
                        if self._backend_ids(backend, text, special, split) != want:
                            return None
        except Exception:  # an unusual tokenizer: keep transformers' encode
            return None
        return backend

    @staticmethod
    def _backend_ids(backend, text: str, add_special_tokens: bool,
                     split_special_tokens: bool = False) -> list[int]:
        """Splitting special-token text is a flag on the backend (`encode_special_tokens`) that
        transformers also sets for each of its calls: set before every call here too, so it
        never carries over from another call (encoding stays on one thread at a time, as with
        transformers)."""
        backend.encode_special_tokens = split_special_tokens
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    def fewest_tokens(self, text: str) -> int:
        """A lower bound of the tokens `text` encodes to, from its length alone: O(1), so a
        text far past any context is refused before it is tokenized (which takes seconds for
        megabytes). 0 where this tokenizer allows no bound (see _max_token_chars)."""
        if self._max_token_chars is None:
            return 0
        return len(text) // (self._max_token_chars * _NORMALIZE_SHRINK)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def load(cls, path, model_eos_ids=()) -> "Tokenizer":
        """From an HF model folder or a .gguf file."""
        path = Path(path)
        if path.is_dir():
            return cls.from_folder(path, model_eos_ids)
        return cls.from_gguf(path, model_eos_ids)

    @classmethod
    def from_folder(cls, folder, model_eos_ids=()) -> "Tokenizer":
        from transformers import AutoTokenizer
        need = "the folder needs tokenizer.json (or tokenizer.model / vocab.json) from the model"
        # transformers >= 5 quietly builds an empty tokenizer when the files are absent
        if not any((Path(folder) / n).is_file() for n in _TOKENIZER_FILES):
            raise ModelLoadError(f"{folder} has no tokenizer files; {need}")
        try:
            hf = AutoTokenizer.from_pretrained(str(folder))
        except Exception as e:  # transformers raises OSError/ValueError/... for bad files
            raise ModelLoadError(f"can't load the tokenizer in {folder} ({e}); {need}") from e
        if len(hf) < 2:
            raise ModelLoadError(f"the tokenizer in {folder} is empty; {need}")
        return cls(hf, model_eos_ids)

    @classmethod
    def from_gguf(cls, path, model_eos_ids=(), cache_key: Optional[str] = None,
                  quiet: bool = True) -> "Tokenizer":
        """`cache_key`: GGUFFile.metadata_sha256() if the caller has it (saves a parse). Unless
        `quiet`, the first conversion (seconds; cached for the next start) says so on stderr."""
        import transformers
        from transformers import AutoTokenizer
        path = Path(path)
        if cache_key is None:
            from outpace.models.loader.gguf import GGUFFile
            cache_key = GGUFFile(path).metadata_sha256()
        from outpace.models.catalog import cache_dir
        cached = cache_dir() / "tokenizers" / f"{cache_key[:32]}-tf{transformers.__version__}"
        if (cached / "tokenizer_config.json").is_file():
            try:
                return cls(AutoTokenizer.from_pretrained(str(cached)), model_eos_ids)
            except Exception:
                pass  # a damaged cache entry: rebuild it from the GGUF below
        if not quiet:
            print(f"outpace: converting the tokenizer of {path.name} (once: it is cached in "
                  f"{cached.parent})", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as e:
            raise ModelLoadError(f"can't build a tokenizer from the metadata of {path} ({e}); "
                                 "the GGUF lacks tokenizer.ggml.* keys or uses an unsupported "
                                 "tokenizer model") from e
        _save_atomically(hf, cached)
        if not quiet:
            print(f"outpace: tokenizer converted in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
        return cls(hf, model_eos_ids)

    # ---- API ----------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template or getattr(self.hf, "chat_template", None))

    def with_chat_template(self, template: str) -> "Tokenizer":
        """A tokenizer that renders chats with `template` (chat_template.load_chat_template's
        result) instead of the model's; this one is left as it is (engines may share it). A
        template that can't render a one-message conversation is a ConfigError, at start-up
        rather than at the first request."""
        tok = copy.copy(self)
        tok.chat_template = template
        try:
            tok._render([{"role": "user", "content": "hi"}], True)
        except Exception as e:  # noqa: BLE001 -- jinja raises many kinds
            raise ConfigError(f"chat_template fails to render a conversation of one user "
                              f"message: {type(e).__name__}: {e}", option="chat_template"
                              ) from None
        return tok

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True,
               split_special_tokens: bool = False) -> list[int]:
        """split_special_tokens: special-token text in `text` is plain text (message content)."""
        if self._backend_encoder is not None:
            return self._backend_ids(self._backend_encoder, text, add_special_tokens,
                                     split_special_tokens)
        return self.hf.encode(text, add_special_tokens=add_special_tokens,
                              split_special_tokens=split_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)  # tensors and arrays too
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context_ids: list, skip_special_tokens: bool = True):
        """A step function token id -> new text or None (held back), from the `tokenizers`
        library's DecodeStream seeded with context_ids; or None where it would not give
        exactly IncrementalDetokenizer's per-token text: transformers' decode differs from the
        backend's (clean-up), the context ends inside a character (its completion belongs to
        the prompt; DecodeStream would emit it), or the library is too old for seeded streams.

        Why: the per-token algorithm decodes two windows per token through Python; the stream
        does the same in one call into Rust, in less than half the time, and detokenization is
        a large part of a batch-128 step's host time (docs/decisions.md, "Detokenization runs
        in the tokenizers library where it gives the same text")."""
        if self._backend_decode is None:
            return None
        try:
            from tokenizers.decoders import DecodeStream
            if "\ufffd" in self.decode(context_ids, skip_special_tokens):
                return None
            stream = DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        except Exception:  # no DecodeStream, or one without ids=
            return None
        return functools.partial(stream.step, self.hf._tokenizer)

    def convert_ids_to_tokens(self, ids):
        return self.hf.convert_ids_to_tokens(ids)

    def _render(self, messages: list, add_generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(messages, chat_template=self.chat_template,
                                           tokenize=False,
                                           add_generation_prompt=add_generation_prompt)

    def _checked_messages(self, messages) -> list:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of {role, content}")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise InvalidRequestError(f"messages[{i}] must be an object with 'role' and "
                                          "'content'")
            if m["role"] not in CHAT_ROLES:
                raise InvalidRequestError(f"messages[{i}].role {m['role']!r} is invalid; use one "
                                          f"of {', '.join(CHAT_ROLES)}")
            clean.append({**m, "content": _flatten_content(m.get("content") or "", i)})
        if not self.has_chat_template:
            raise InvalidRequestError("this model has no chat template; send a plain prompt to "
                                      "the completions API instead, or give one with "
                                      "chat_template (CLI --chat-template)")
        return clean

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        """Render chat messages to the prompt text; bad messages raise InvalidRequestError.

        The text holds the template's special tokens, and whatever special-token text the
        messages hold: to tokenize a chat, use chat_token_ids (or render_chat, then
        encode_chat), which keep the two apart."""
        return self._render_checked(messages, add_generation_prompt)[1]

    def _render_checked(self, messages, add_generation_prompt: bool) -> tuple:
        clean = self._checked_messages(messages)
        try:
            return clean, self._render(clean, add_generation_prompt)
        except Exception as e:  # jinja2 TemplateError, raise_exception() inside templates
            raise InvalidRequestError(f"the chat template rejected the messages: {e}") from e

    def render_chat(self, messages, add_generation_prompt: bool = True) -> ChatPrompt:
        """Render chat messages (jinja only, no tokenizing: safe beside another thread's
        tokenizer calls), the messages' content marked where it holds special-token text."""
        clean, text = self._render_checked(messages, add_generation_prompt)
        forged = [(i, s) for i, m in enumerate(clean)
                  if (s := self._special_text.find(m["content"])) is not None]
        if not forged:
            return ChatPrompt(((text, False),))
        try:
            pieces = split_rendering(lambda ms: self._render(ms, add_generation_prompt),
                                     clean, text)
        except Exception:  # noqa: BLE001 -- the template rejects the marks: can't split
            pieces = None
        if pieces is None:
            i, s = forged[0]
            raise InvalidRequestError(
                f"messages[{i}].content holds the special token text {s!r}, and this chat "
                "template changes message content in a way that keeps outpace from telling it "
                "apart from the template's own tokens; remove that text from the message")
        return ChatPrompt(pieces)

    def encode_chat(self, prompt: ChatPrompt) -> list[int]:
        """Token ids of a rendered chat: special tokens are recognised in the template's text
        only; in message content their text is plain text (a user can't forge a turn)."""
        ids = []
        for text, is_content in prompt.pieces:
            ids += self.encode(text, add_special_tokens=False, split_special_tokens=is_content)
        return ids

    def chat_token_ids(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return self.encode_chat(self.render_chat(messages, add_generation_prompt))

    def _special_token_texts(self) -> list:
        texts = set(getattr(self.hf, "all_special_tokens", None) or ())
        for tok in (getattr(self.hf, "added_tokens_decoder", None) or {}).values():
            if getattr(tok, "special", False):
                texts.add(str(tok))
        return sorted(texts)


def _save_atomically(hf, dest: Path) -> None:
    """save_pretrained into a temp dir, then rename; a failure only costs the cache."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tok-"))
        hf.save_pretrained(str(tmp))
        try:
            os.replace(tmp, dest)
        except OSError:  # another process saved it first
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # read-only cache: keep working without it
