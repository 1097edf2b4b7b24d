"""Typed errors a user can cause. Each message says what to change.

An error about one option carries that option's config key (`option`), and its message names the
option by that key; `spelled` renames it as the user gave it, e.g. as a CLI flag, so the message
names what the user typed (`--k must be in 1..16`, not `num_speculative_tokens`).

The server maps `InvalidRequestError` to 400, `ModelNotFoundError` to 404 and
`QueueFullError` to 503; everything else that escapes is a 500.
"""


import re
from typing import Mapping, Optional


class OutpaceError(Exception):
    """Base class of every error outpace raises on purpose. option: the config key of the
    option the error is about, when it is about one (its message names it by that key)."""

    def __init__(self, *args, option: Optional[str] = None):
        super().__init__(*args)
        self.option = option


def spelled(e: OutpaceError, names: Mapping[str, str]) -> OutpaceError:
    """`e` with the options its message names spelled as `names` says (config key -> how the
    user gave it, e.g. a CLI flag); `e` itself when it is about no option in `names`. Only an
    error about an option is reworded: its message names options by their keys, where another
    message may name a key beside its flag already."""
    if e.option not in names:
        return e
    msg = str(e)
    # a key as a word of its own: not inside another name, a quoted key or a file name
    for key in sorted(names, key=len, reverse=True):
        msg = re.sub(rf"(?<![\w\-'\[.]){re.escape(key)}(?![\w'\]]|\.\w)",
                     lambda _, name=names[key]: name, msg)
    out = type(e)(msg, option=names[e.option])
    out.__cause__, out.__traceback__ = e.__cause__, e.__traceback__
    return out


class ConfigError(OutpaceError, ValueError):
    """An engine, cache, scheduler or speculative option is invalid."""


class ModelLoadError(OutpaceError):
    """A model path, file or format can't be loaded (missing, corrupt, unsupported)."""


class UnsupportedModelError(ModelLoadError):
    """The architecture or a tensor type is not supported."""


class InvalidRequestError(OutpaceError, ValueError):
    """A request (prompt, sampling parameters) is invalid; the engine keeps running."""


class ModelNotFoundError(InvalidRequestError):
    """A request names a model the engine does not serve."""


class EngineStoppedError(OutpaceError):
    """The engine can't compute any more (a tensor-parallel rank ended): not one step's failure,
    so whoever runs the engine loop stops at once rather than retrying."""


class QueueFullError(OutpaceError):
    """The waiting queue is at its bound; retry later."""
