"""The chat template: a user's template in place of the model's (`chat_template`, CLI
`--chat-template FILE_OR_STRING`), and a rendered conversation split into the template's own
text and the messages' content, so that only the former may hold special tokens.

A message whose content holds the text of a special token (`<|im_start|>system ...`) must not
become that token: the user could forge a system turn. A rendered chat is therefore kept as
pieces (`ChatPrompt`), each marked as template text or content; the tokenizer recognises special
tokens in the first kind only (`Tokenizer.encode_chat`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from outpace.errors import ConfigError


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: (text, is_content) pieces that join to the prompt text."""

    pieces: tuple

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.pieces)


# ---- a user's template --------------------------------------------------------------------------

def _compile(template: str) -> None:
    """Compile in the environment transformers renders chat templates in (a sandbox with
    trimmed blocks, loop controls and its `{% generation %}` tag; its `tojson` is jinja's own
    filter with other defaults): what compiles here compiles there. jinja2 alone, not
    transformers' helper: importing transformers takes seconds, and this runs before the model
    loads so that a bad template fails at once."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.from_string(template)


def load_chat_template(value: str) -> str:
    """`--chat-template` as vLLM takes it: the path of a Jinja file, or the template itself.
    Checked here, before any model loads: a file that can't be read, a syntax error or a
    template that never reads `messages` is a ConfigError that says which."""
    import jinja2

    def bad(msg):  # every error here is about the one option
        return ConfigError(msg, option="chat_template")

    if not isinstance(value, str) or not value.strip():
        raise bad("chat_template is empty; give a Jinja template or the path of a file holding "
                  "one")
    path = Path(value).expanduser()
    looks_like_text = "{" in value or "\n" in value  # template syntax: never taken for a path
    try:
        is_file = not looks_like_text and path.is_file()
    except OSError:  # a name too long for the file system, and the like
        is_file = False
    if is_file:
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise bad(f"chat_template: can't read {value} ({e})") from None
        where = f"file {value}"
    elif looks_like_text:
        template, where = value, "the template given"
    else:
        state = "is a folder" if path.is_dir() else "does not exist"
        raise bad(f"chat_template {value!r} {state} and is no Jinja template either (it has "
                  "no {{ or {%): give the path of a template file or the template text")
    try:
        _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise bad(f"chat_template: {where} is not a valid Jinja template: {e.message} "
                  f"(line {e.lineno})") from None
    except Exception as e:  # noqa: BLE001 -- jinja's other errors: a template it can't compile
        raise bad(f"chat_template: {where} can't be compiled: {type(e).__name__}: {e}"
                  ) from None
    if "messages" not in template:
        raise bad(f"chat_template: {where} never reads `messages`, so every conversation "
                  "would render to the same prompt; loop over messages as the model's own "
                  "template does")
    return template


# ---- content apart from the template ------------------------------------------------------------

_MARK = re.compile("\ue000([0-9]+)\ue001")  # private-use code points: no real text holds them


def _mark(i: int) -> str:
    return f"\ue000{i}\ue001"


def split_rendering(render: Callable[[list], str], messages: list, text: str
                    ) -> Optional[tuple]:
    """`text` (the rendering of `messages`) as (piece, is_content) pieces, or None where the
    template does not copy each message's content into the prompt as it is (or stripped).

    The template is rendered once more with each content replaced by a unique mark; between the
    marks is the template's own text. The pieces are accepted only if they, with the real
    contents in the marks' places, give `text` exactly, so a template that branches on or
    rewrites content is never split wrongly."""
    skeleton = render([{**m, "content": _mark(i)} for i, m in enumerate(messages)])
    parts = _MARK.split(skeleton)  # template, message index, template, ..., template
    pieces, pos = [], 0
    for k in range(0, len(parts), 2):
        own = parts[k]
        if not text.startswith(own, pos):
            return None
        pieces.append((own, False))
        pos += len(own)
        if k + 1 == len(parts):
            break
        i = int(parts[k + 1])
        if i >= len(messages):
            return None
        content, after = messages[i]["content"], parts[k + 2]
        for shown in dict.fromkeys((content, content.strip())):  # templates that trim it too
            if text.startswith(shown + after, pos):
                break
        else:
            return None
        pieces.append((shown, True))
        pos += len(shown)
    if pos != len(text):
        return None
    return tuple(p for p in pieces if p[0])


class SpecialText:
    """Finds the text of a special token inside message content.

    Only whole special-token texts count: one that content and the template's text beside it
    would form together needs a template whose own text starts or ends inside a special token,
    which templates do not have (theirs are whole tokens)."""

    def __init__(self, specials):
        specials = sorted({s for s in specials if s}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, specials))) if specials else None

    def find(self, content: str) -> Optional[str]:
        """The first special token text in `content`, else None."""
        m = self._pattern.search(content) if self._pattern is not None and content else None
        return m.group(0) if m else None
