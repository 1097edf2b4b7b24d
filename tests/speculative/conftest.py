"""Fixtures for the speculative-decoding tests: a tiny peaked target and random draft heads for
it (session-wide, built in well under a second), the real default model comes from
tests/conftest.py."""

import os

# On a shared 2-core machine OpenMP threads spinning at barriers make every forward many times
# slower (see tests/models/conftest.py). Only effective if torch is not imported yet.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_loaded():
    """(model, ModelConfig, TinyTokenizer) of the tiny peaked target, shared by engines."""
    from tests.speculative.spec_helpers import tiny_target
    return tiny_target(seed=0)


@pytest.fixture(scope="session")
def tiny_heads(tiny_loaded, tmp_path_factory):
    """{"eagle3": folder, "mtp": folder}: random heads (init_draft) shaped for the tiny target."""
    from outpace.training.init_draft import init_draft
    from tests.speculative.spec_helpers import write_target_folder
    root = tmp_path_factory.mktemp("tiny_heads")
    target = write_target_folder(tiny_loaded[1], root / "target")
    return {m: init_draft(m, str(target), root / m, seed=1, quiet=True) for m in ("eagle3", "mtp")}


@pytest.fixture(scope="session")
def real_heads(default_model_path, tmp_path_factory):
    """A random EAGLE-3 head for the real default model."""
    from outpace.training.init_draft import init_draft
    root = tmp_path_factory.mktemp("real_heads")
    return {"eagle3": init_draft("eagle3", str(default_model_path), root / "eagle3", seed=1,
                                 quiet=True)}


class RerunGraph:
    """A CPU stand-in for a CUDA graph: replay re-runs the captured function and copies its
    results into the captured outputs, exactly as a graph re-reads its fixed input buffers and
    rewrites its fixed outputs."""

    def __init__(self, fn):
        self.fn = fn
        self.outs = fn()

    def replay(self):
        _copy_into(self.outs, self.fn())


def _copy_into(dst, src):
    if isinstance(dst, (list, tuple)):
        for a, b in zip(dst, src):
            _copy_into(a, b)
    else:
        dst.copy_(src)


def rerun_capture(fn):
    """A stand-in for GraphRunner's CUDA graph capture (enable_cuda_graphs(capture=...)), so
    graph bucketing and padding run on CPU: fn -> (RerunGraph(fn), its outputs)."""
    g = RerunGraph(fn)
    return g, g.outs
