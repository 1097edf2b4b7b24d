"""Programmatic dependent launch (PDL) for the decode step's Triton kernels.

Why: at batch 1 a small model's step is a chain of ~200 kernels of a few microseconds each,
and each one pays its launch and its first DRAM latency (the weight tile) only after the
previous kernel has drained. With PDL (Hopper and later) the next kernel is launched while
the previous one runs; it loads what no earlier kernel writes (its weights) and then waits on
the grid dependency, so its launch and weight read hide behind the previous kernel. CUDA graphs
keep the dependency as a programmatic edge.

The protocol every kernel launched with PDL follows (`wait_then_release`):
  1. a prologue that writes nothing and only reads memory that no kernel of the step writes
     (weights, norm weights) or that only kernels at least two launches back wrote: those
     have finished, since the predecessor released this kernel only after its own wait
     (the attention kernel reads the step's block tables and the KV of earlier tokens here,
     bypassing L1);
  2. `gdc_wait`: every earlier kernel has finished and its writes are visible;
  3. `gdc_launch_dependents`: the next kernel may now launch and run its own prologue;
  4. the rest of the kernel.
Every program executes step 2 before it can return, so a kernel finishes only after its
predecessor did, and "finished" stays transitive along the chain. Releasing only after the wait
keeps at most two kernels resident at a time. Kernels launched without PDL (torch's, cuBLAS)
wait for full completion as always; gdc ops are no-ops in a kernel launched without PDL.

KernelOptions.pdl switches it off (kernels/options.py: benchmarks compare both);
`launch_options` returns the launch keyword and the kernels' USE_PDL flag together, so a kernel
launched with PDL always waits.
"""

from __future__ import annotations

import torch

from outpace.kernels.options import current

try:  # guarded: CPU machines may not have triton, and `import outpace` must still work
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

# The kinds of graph replayed from the host (prime's site): "step" (a fused step: launch,
# relaunch, a prefill's tail), "prefill" (a single request's prefill graph), "varlen", "head"
# (a draft head's graph after a prefill or varlen step), "plain" (the general path's decode
# graphs). Those in KernelOptions.pdl_prime_skip are not primed: a prime does not help every
# graph. Priming the varlen and head graphs raises TTFT and lowers throughput at batch 8-32; the
# prefill graph's prime keeps a fresh engine's first batch-1 requests at full speed, so it
# stays. "plain" is not measured and is left unprimed. docs/decisions.md, "PDL primed before
# fused steps and prefill graphs launched from the host".
_by_device: dict = {}  # device index -> whether PDL is supported there (a fact, cached)


def _triton_has_launch_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_rule(capability: tuple[int, int], hip: str | None, triton_launch_pdl: bool) -> bool:
    """Whether a GPU with these facts takes PDL: NVIDIA (ROCm reports its own capability
    numbers; PDL is NVIDIA's), compute capability >= 9.0, and a triton whose launcher takes
    `launch_pdl` (3.4+)."""
    return hip is None and capability[0] >= 9 and triton_launch_pdl


def supported(device: torch.device, facts: tuple | None = None) -> bool:
    """Whether PDL can be used on `device` (pdl_rule). facts: (capability, torch.version.hip,
    triton has launch_pdl) to judge instead of querying the device (not cached); None (callers'
    default): the device's own, queried once per device."""
    if device.type != "cuda" or triton is None:
        return False
    if facts is not None:
        return pdl_rule(*facts)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _by_device.get(idx)
    if ok is None:
        ok = pdl_rule(*device_facts(idx))
        _by_device[idx] = ok
    return ok


def device_facts(idx: int) -> tuple:
    """`supported`'s facts for CUDA device `idx`: (capability, torch.version.hip, whether
    triton's launcher takes launch_pdl)."""
    return torch.cuda.get_device_capability(idx), torch.version.hip, _triton_has_launch_pdl()


def prime(device: torch.device, site: str = "step") -> None:
    """Launch one empty PDL kernel on the current stream, where PDL is on: call it after work
    launched eagerly and before replaying a CUDA graph of PDL kernels.

    Why: a graph's replays run at a speed set by the last kernel launched eagerly on the
    stream before them. After a torch or cuBLAS kernel (one small fill is enough) a graph of
    PDL kernels replays slower than after a PDL-launched Triton kernel, for as long as
    nothing else is launched eagerly: every target layer's kernels overlap less. Graph
    replays and memory copies leave it as it is. The engine's host-launched graph steps follow
    eager work (a varlen step's sampling, a general-path step), so they prime first; chained
    steps follow a graph. The driver-level cause is not known; docs/decisions.md has the
    measurements ("graph replays ran at a speed set by the last eager kernel").

    site: the kind of graph about to be replayed; those in KernelOptions.pdl_prime_skip are not primed (the
    effect is not the same for every graph)."""
    o = current()
    if o.pdl and o.pdl_prime and site not in o.pdl_prime_skip and supported(device):
        _primer_kernel[(1,)](USE_PDL=True, launch_pdl=True)


def launch_options(t: torch.Tensor, facts: tuple | None = None) -> dict:
    """Keyword arguments for a kernel launch on t's device: {'USE_PDL': bool} plus
    'launch_pdl': True when PDL is on. Pass them to kernels that call wait_then_release.
    facts: `supported`'s (None: the device's own)."""
    if current().pdl and supported(t.device, facts):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


if triton is not None:

    @triton.jit
    def wait_then_release(USE_PDL: tl.constexpr):
        # Steps 2 and 3 of the protocol above; call it after the static prologue and before
        # the first load of anything an earlier kernel writes (and before any early return).
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _primer_kernel(USE_PDL: tl.constexpr):
        # `prime`'s kernel: the protocol's wait and release, nothing else
        wait_then_release(USE_PDL)
