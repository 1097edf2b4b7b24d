"""Typed errors a user can cause. Each message says what to change.

The server maps `InvalidRequestError` to 400, `ModelNotFoundError` to 404 and
`QueueFullError` to 503; everything else that escapes is a 500.
"""


class OutpaceError(Exception):
    """Base class of every error outpace raises on purpose."""


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


class QueueFullError(OutpaceError):
    """The waiting queue is at its bound; retry later."""
