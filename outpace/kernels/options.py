"""The KernelOptions in force (runner_config.KernelOptions: the switches of the CUDA fast path).

Each field turns one kernel-level choice off for benchmarks' ablations and for tests that pin
a path; the defaults are what the engine runs. `RunnerConfig.kernel_options` carries them, and
the model runner puts them in force (`use_kernel_options`) around everything it launches: its
steps, graph captures and warm-up, so a captured graph holds the kernels its engine's options
chose. Kernels and models read `current()`. Outside a runner (a kernel test, a micro-benchmark)
the defaults apply unless a `with use_kernel_options(...)` block says otherwise.
"""

from __future__ import annotations

import contextlib
import contextvars

from outpace.runner_config import KernelOptions

DEFAULT = KernelOptions()
_current: contextvars.ContextVar = contextvars.ContextVar("outpace_kernel_options",
                                                          default=DEFAULT)


def current() -> KernelOptions:
    """The options in force here (the defaults outside any use_kernel_options block)."""
    return _current.get()


@contextlib.contextmanager
def use_kernel_options(options: KernelOptions):
    """Put `options` in force for the block (this thread or task only)."""
    token = _current.set(options)
    try:
        yield options
    finally:
        _current.reset(token)
