"""Request models (pydantic, strict types) and response builders of the OpenAI-compatible API.

Requests are validated strictly (a string where a number belongs is a 400, as with OpenAI);
unknown fields are ignored. Fields whose JSON shape is a union (prompt, stop, message content)
are checked by hand so the error message names the accepted shapes. Responses are built as plain
dicts: the stream path builds one per token, and pydantic would only add cost there.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, ValidationError

from outpace.entrypoints.openai.errors import APIError
from outpace.types import SamplingParams

MAX_LOGPROBS = 20


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields shared by completions and chat (OpenAI's, then vLLM's extras)."""

    model: Optional[str] = None  # None: the one model the server serves
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Any = None  # str | list[str] | None, checked in stop_list()
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict] = None
    user: Optional[str] = None

    def stop_list(self) -> list:
        s = self.stop
        if s is None:
            return []
        if isinstance(s, str):
            s = [s]
        if not isinstance(s, list) or not all(isinstance(x, str) and x for x in s):
            raise APIError(400, "stop must be a non-empty string or a list of non-empty strings",
                           param="stop")
        if len(s) > 16:
            raise APIError(400, f"stop has {len(s)} strings; give at most 16", param="stop")
        return s

    def check_common(self, max_model_len: int) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported; outpace returns one choice (n=1)",
                           param="n")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported; leave it out", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           param="stream_options")
        # Values the sampler turns into int64 tensors / torch generators: out of range there
        # would fail a whole engine step (every request in it), so refuse them here.
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 64):
            raise APIError(400, "seed must fit in 64 bits", param="seed")
        if self.top_k is not None and self.top_k > (1 << 31):
            raise APIError(400, f"top_k={self.top_k} is too large; use 0 for no top-k",
                           param="top_k")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {self.max_tokens}",
                           param="max_tokens")
        if self.max_tokens is not None and self.max_tokens >= max_model_len:
            raise APIError(400, f"max_tokens={self.max_tokens} does not fit this model's "
                           f"context of {max_model_len} tokens (prompt and output together); "
                           "lower max_tokens", param="max_tokens")

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
        """SamplingParams validates ranges itself (InvalidRequestError -> 400)."""
        def pick(v, default):
            return default if v is None else v

        return SamplingParams(
            max_tokens=max_tokens, temperature=pick(self.temperature, 1.0),
            top_p=pick(self.top_p, 1.0), top_k=pick(self.top_k, 0), min_p=pick(self.min_p, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            presence_penalty=pick(self.presence_penalty, 0.0), seed=self.seed,
            stop=self.stop_list(), stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            # a response sent whole needs only the finished output (no per-step ones)
            output_kind="cumulative" if self.stream else "final_only")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: Any  # str | [str] | [int] | [[int]], one prompt; checked in prompt_input()
    max_tokens: Optional[int] = 16  # OpenAI's default for completions
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def prompt_input(self):
        """The one prompt as str or list[int]."""
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise APIError(400, "prompt is empty; give at least one character or token",
                               param="prompt")
            return p
        if isinstance(p, list) and p and all(_is_int(t) for t in p):
            return p
        if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
            raise APIError(400, f"prompt holds {len(p)} prompts; send one prompt per request",
                           param="prompt")
        raise APIError(400, "prompt must be a string, a list of token ids (non-negative "
                       "integers), or a list holding one of those", param="prompt")

    def check(self, max_model_len: int) -> None:
        self.check_common(max_model_len)
        if self.echo:
            raise APIError(400, "echo is not supported; leave it out or set it false",
                           param="echo")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported; leave it out", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported; leave it out", param="suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}",
                           param="logprobs")


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Any = None
    content: Any = None  # str | [{"type": "text", "text": str}] | None (assistant only)
    name: Optional[str] = None


class _ChatMessages(_Strict):
    """A conversation to render with the chat template (chat completions, /tokenize)."""

    messages: list[ChatMessage]
    add_generation_prompt: bool = True

    def template_messages(self) -> list:
        """Messages as the chat template wants them: [{"role", "content": str}]."""
        if not self.messages:
            raise APIError(400, "messages is empty; give at least one message", param="messages")
        out = []
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            if m.role not in CHAT_ROLES:
                raise APIError(400, f"{where}.role is {m.role!r}; use one of "
                               f"{', '.join(CHAT_ROLES)}", param=f"{where}.role")
            out.append({"role": "system" if m.role == "developer" else m.role,
                        "content": _content_text(m.content, m.role, where)})
        return out


class ChatCompletionRequest(_SamplingFields, _ChatMessages):
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list] = None
    tool_choice: Any = None
    response_format: Optional[dict] = None

    def check(self, max_model_len: int) -> None:
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins
            self.max_tokens = self.max_completion_tokens
        self.check_common(max_model_len)
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs must be in 0..{MAX_LOGPROBS}, "
                               f"got {self.top_logprobs}", param="top_logprobs")
        if self.tools or self.tool_choice not in (None, "none"):
            raise APIError(400, "tool calling is not supported; leave tools out", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format {\"type\": \"text\"} is supported",
                           param="response_format")


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: {"model", "prompt"} or {"model", "messages", "add_generation_prompt"};
    `add_special_tokens` (prompt only, default true) and `return_token_strs` as vLLM has them."""

    model: Optional[str] = None
    prompt: Any = None  # str, checked in check()
    messages: Optional[list[ChatMessage]] = None
    add_generation_prompt: bool = True
    add_special_tokens: Optional[bool] = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt (a string) or messages (a conversation)",
                           param="prompt")
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise APIError(400, "prompt must be a string", param="prompt")
        if self.messages is not None and self.add_special_tokens:
            raise APIError(400, "add_special_tokens applies to a prompt; the chat template "
                           "adds the special tokens of messages itself",
                           param="add_special_tokens")

    def chat(self) -> _ChatMessages:
        return _ChatMessages(messages=self.messages,
                             add_generation_prompt=self.add_generation_prompt)


class DetokenizeRequest(_Strict):
    """vLLM's /detokenize: {"model", "tokens"} -> {"prompt"}."""

    model: Optional[str] = None
    tokens: list[int]


def _content_text(content, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}.content[{j}] must be {{\"type\": \"text\", "
                               "\"text\": \"...\"}; only text content is supported",
                               param=f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(400, f"{where}.content must be a string or a list of text parts",
                   param=f"{where}.content")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---- parsing ------------------------------------------------------------------------------------

def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON")


MAX_JSON_DEPTH = 32  # an OpenAI request nests 5 levels at most (tools' schemas a few more)
# a string, or an unterminated one to the end of the text: every attempt succeeds at once, so
# the scan stays linear whatever the body (a pattern that can fail re-reads the rest each time);
# runs of plain characters are taken whole, not a character per alternation (megabytes of
# prompt are scanned on the event loop)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\(?:.|\Z)[^"\\]*)*(?:"|\Z)', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def json_depth(text: str) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings aside),
    without parsing it: a deep body would exhaust the parser's and the validators' recursion."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    depth = deepest = 0
    for c in brackets:
        if c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_JSON_DEPTH:
                    break
        else:
            depth -= 1
    return deepest


def parse_body(body: bytes) -> dict:
    """Bytes -> JSON object, with a 400 that says what is wrong."""
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (bad byte at offset {e.start})")
    if json_depth(text) > MAX_JSON_DEPTH:
        raise APIError(400, f"the request body nests arrays and objects more than "
                       f"{MAX_JSON_DEPTH} levels deep")
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}")
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(obj).__name__}")
    # "\ud800" is valid JSON but no tokenizer can take a lone surrogate. Decoded UTF-8 holds
    # none, so only a \u escape can make one: bodies without such an escape skip the check.
    try:
        if _SURROGATE_ESCAPE.search(text):
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the request holds an unpaired UTF-16 surrogate (\\ud800-\\udfff); "
                       "send valid Unicode text")
    return obj


def validate(model_cls, obj: dict):
    try:
        return model_cls.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        got = err.get("input")
        got_s = "" if isinstance(got, dict) else f" (got {json.dumps(got)[:80]})"
        raise APIError(400, f"{loc}: {err['msg']}{got_s}", param=loc or None)


# ---- responses ----------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(num_prompt: int, num_output: int, num_cached: int = 0) -> dict:
    u = {"prompt_tokens": num_prompt, "completion_tokens": num_output,
         "total_tokens": num_prompt + num_output}
    if num_cached:
        u["prompt_tokens_details"] = {"cached_tokens": num_cached}
    return u


LOGPROB_FLOOR = -9999.0  # JSON has no -inf


def _lp(x) -> float:
    return max(float(x), LOGPROB_FLOOR)


def _top(d: dict, n: int) -> list:
    return sorted(d.items(), key=lambda kv: kv[1], reverse=True)[:n]


def completion_logprobs(token_ids, lps, pieces, n_top: int, text_start: int) -> dict:
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_start
    for t, d in zip(token_ids, lps):
        piece = pieces.get(t, "")
        tokens.append(piece)
        token_lps.append(_lp(d.get(t, LOGPROB_FLOOR)))
        tops.append({pieces.get(k, ""): _lp(v) for k, v in _top(d, n_top)} if n_top else None)
        offsets.append(off)
        off += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(token_ids, lps, pieces, n_top: int) -> dict:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(tok_id, lp):
        piece = pieces.get(tok_id, "")
        return {"token": piece, "logprob": _lp(lp), "bytes": list(piece.encode("utf-8"))}

    content = []
    for t, d in zip(token_ids, lps):
        e = entry(t, d.get(t, LOGPROB_FLOOR))
        e["top_logprobs"] = [entry(k, v) for k, v in _top(d, n_top)]
        content.append(e)
    return {"content": content}
