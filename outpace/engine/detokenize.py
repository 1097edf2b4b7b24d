"""Incremental detokenization and stop strings, one token at a time.

Decoding a window of recent tokens (not the whole output) keeps each token O(window). A token
that ends inside a multi-byte character decodes to U+FFFD; its text is held back until the
character completes. Tokens are fed one by one so that a stop string ends the output at exactly
the token that completed it, however many tokens a speculative step committed.

Where the tokenizer offers it (`Tokenizer.decode_stream`), the same algorithm runs inside the
`tokenizers` library, one call a token; should the stream ever fail, the text is rebuilt by the
Python algorithm from the start (it gives the same text) and that one continues.
"""

from __future__ import annotations

from typing import Optional

# Prompt tokens decoded in front of the output so that the first output token gets the spacing
# it has in context (sentencepiece drops a leading space when decoded alone).
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list, skip_special_tokens: bool = True,
                 stop: Optional[list] = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.stopped_by: Optional[str] = None
        self._num_context = len(self.ids)
        make_stream = getattr(tokenizer, "decode_stream", None)
        self._stream = make_stream(self.ids, skip_special_tokens) if make_stream else None

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add_token(self, token_id: int) -> Optional[str]:
        """Append one token; returns the stop string if this token completed one."""
        self.ids.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream(token_id)
            except Exception:
                return self._rebuild()
            if not piece:
                return None
            start = len(self.text)
            self.text += piece
            return self._check_stop(start)
        return self._step()

    def _step(self) -> Optional[str]:
        # the per-token algorithm, for the token just appended to self.ids
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            start = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return self._check_stop(start)
        return None

    def _rebuild(self) -> Optional[str]:
        """The stream failed: recompute the text token by token in Python (a prefix of it is
        what the stream produced), then go on in Python; stop strings only in the new part."""
        self._stream = None
        ids, done = self.ids, len(self.text)
        self.ids, self.text = ids[:self._num_context], ""
        self.prefix_offset, self.read_offset = 0, self._num_context
        stop, self.stop = self.stop, []  # no stop checks while replaying
        for t in ids[self._num_context:]:
            self.ids.append(t)
            self._step()
        self.stop = stop
        return self._check_stop(done)

    def _check_stop(self, new_start: int) -> Optional[str]:
        if not self.stop:
            return None
        # A stop string may straddle the old text and the new piece.
        lo = max(0, new_start - self.max_stop_len + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, lo)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        self.stopped_by = s
        return s

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: while running, hold back what may still become a stop string."""
        if finished or self.stopped_by is not None or not self.stop:
            return self.text
        hold = 0
        for s in self.stop:
            hold = max(hold, _partial_stop(self.text, s))
        return self.text[:len(self.text) - hold] if hold else self.text


def _partial_stop(text: str, stop: str) -> int:
    """The length of the longest proper prefix of `stop` that `text` ends with (0: none). Only
    the places in text's last len(stop) - 1 characters where stop's first character occurs are
    tried, each with one C-level comparison."""
    tail = text[len(text) - min(len(stop) - 1, len(text)):]
    j = tail.find(stop[0])
    while j != -1:
        if stop.startswith(tail[j:]):
            return len(tail) - j
        j = tail.find(stop[0], j + 1)
    return 0
