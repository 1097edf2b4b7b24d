"""The Triton interpreter's run (tests/unit/test_kernels_interpret.py) starts as soon as
collection ends, in its own process, and its test later waits for it: the suite's steps on the
tiny models run torch on one thread (tests/conftest.py), so on a 2-core machine the run takes
the core they leave idle instead of adding its time to the suite's."""

from __future__ import annotations


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    from tests.unit import test_kernels_interpret as interpret
    if interpret.triton_installed() and any(
            getattr(item, "function", None) is interpret.test_kernels_under_triton_interpreter
            for item in session.items):
        session.config.stash[interpret.INTERPRETER_RUN] = interpret.InterpreterRun()


def pytest_sessionfinish(session):
    from tests.unit import test_kernels_interpret as interpret
    run = session.config.stash.get(interpret.INTERPRETER_RUN, None)
    if run is not None:
        run.stop()  # (a run cut short, by -x or Ctrl-C, leaves no child behind)
