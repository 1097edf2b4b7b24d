"""An option's value checked where several configs share the rule: the error names the option
(`OutpaceError.option`), so the CLI can respell it as its flag (errors.spelled)."""

from __future__ import annotations

from typing import Optional

from outpace.errors import ConfigError


def check_share(name: str, v) -> None:
    """A share of memory: a number in (0, 1]."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
        raise ConfigError(f"{name} must be a number in (0, 1], got {v!r}", option=name)


def check_int(name: str, v, lo: int, hi: Optional[int] = None, why: str = "") -> None:
    """An integer option (not a bool) in lo..hi; the error names it (ConfigError.option)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise ConfigError(f"{name} must be an integer {bound}{why}, got {v!r}", option=name)
