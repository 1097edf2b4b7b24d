"""Draft heads shipped inside the package, for the catalog's default model.

`speculative_config={"method": "eagle3"}` (or `--spec eagle3`) with no draft path takes the
shipped head when the target is a catalog model that has one: the catalog name itself, or a
file that is that model (its size, then its sha256). Any other target needs a draft path, and
the error says how to make one (`outpace train-draft`).

The heads live in outpace/heads/<catalog name>-<method>/ (config.json + model.safetensors).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path
from typing import Optional

from outpace.errors import ConfigError
from outpace.models.catalog import CATALOG

HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"
# (catalog name, method) -> folder under HEADS_DIR
SHIPPED = {("smollm2-135m", "eagle3"): "smollm2-135m-eagle3",
           ("smollm2-135m", "mtp"): "smollm2-135m-mtp"}
HEAD_METHODS = ("eagle3", "mtp")


@lru_cache(maxsize=16)
def _file_is(path: str, size: int, mtime_ns: int, sha256: str) -> bool:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest() == sha256


def catalog_name_of(model) -> Optional[str]:
    """The catalog name `model` (a name or a path) is, or None."""
    key = str(model)
    if key.lower() in CATALOG:
        return key.lower()
    p = Path(key).expanduser()
    try:
        st = p.stat()
    except OSError:
        return None
    if not p.is_file():
        return None
    for name, entry in CATALOG.items():
        if st.st_size == entry.size and _file_is(str(p.resolve()), st.st_size, st.st_mtime_ns,
                                                 entry.sha256):
            return name
    return None


def shipped_head(model, method: str) -> Optional[Path]:
    """The shipped `method` head's folder for `model`, or None."""
    name = catalog_name_of(model)
    folder = SHIPPED.get((name, method)) if name else None
    if folder is None:
        return None
    path = HEADS_DIR / folder
    return path if (path / "config.json").is_file() else None


def with_shipped_head(speculative_config: Optional[dict], model) -> Optional[dict]:
    """speculative_config with the shipped head's path as its draft model where it names a head
    method and no draft model. Raises ConfigError (naming `outpace train-draft`) when the
    target has no shipped head."""
    if not speculative_config:
        return speculative_config
    method = speculative_config.get("method")
    if method not in HEAD_METHODS or speculative_config.get("model"):
        return speculative_config
    path = shipped_head(model, method)
    if path is None:
        raise ConfigError(
            f"speculative method {method!r} needs a draft head, and none ships for {model}: "
            f"train one with `outpace train-draft --method {method} --target {model} --data "
            f"PROMPTS.jsonl --out DIR` and pass it as speculative_config['model'] (CLI: "
            f"--draft DIR)")
    return {**speculative_config, "model": str(path)}
