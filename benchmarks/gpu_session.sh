#!/usr/bin/env bash
# One GPU call's work on the device machine: rebuild the staged
# model, install the carried gguf wheel, then run what is asked:
#   bash benchmarks/gpu_session.sh tests            pytest tests/gpu
#   bash benchmarks/gpu_session.sh bench SECTIONS [ARGS]     throughput.py --sections SECTIONS
#   bash benchmarks/gpu_session.sh accuracy SECTIONS [ARGS]  accuracy.py --sections SECTIONS (check, spec_exact)
#   bash benchmarks/gpu_session.sh methods [ARGS]  methods.py (every method against no speculation)
#   bash benchmarks/gpu_session.sh diag [ARGS]     archive/diag_step.py (where a fused step's time goes)
#   bash benchmarks/gpu_session.sh rows [ARGS]     archive/diag_few_rows.py (few-row block policies in the step)
#   bash benchmarks/gpu_session.sh request        archive/diag_request.py (a batch-1 request's steps and idle GPU)
#   bash benchmarks/gpu_session.sh launch          archive/diag_launch.py (what makes a graph slow to launch)
#   bash benchmarks/gpu_session.sh cublas          archive/diag_cublas_workspace.py (graphs vs a cleared cuBLAS workspace)
#   bash benchmarks/gpu_session.sh sweep MS         kernel_speed.py's sweep at those M
#   bash benchmarks/gpu_session.sh serve CONFIGS [ARGS]  serve.py's suite (--start-server): CONFIGS e.g. no-spec,ngram-k3
# Results go to $OUT (the device tool brings them back). The device's copy of .git can be stale
# (it can report an older HEAD): prefix the call with OUTPACE_COMMIT=$(git rev-parse --short HEAD)
# taken here.
# Without staged parts (tests, or the no-model sections overlap,big) the model steps are skipped.
# .whl/ holds the wheels to carry: gguf, and pytest-xdist + execnet for the tests
# (pip download --no-deps -d .whl gguf pytest-xdist execnet).
set -euo pipefail
GGUF=none
if ls /root/keep/part_* > /dev/null 2>&1 || [ -f /root/keep/smollm2.gguf ]; then
  if [ ! -f /root/keep/smollm2.gguf ]; then
    cat /root/keep/part_* > /root/keep/smollm2.gguf
  fi
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /root/keep/smollm2.gguf" \
    | sha256sum -c
  GGUF=/root/keep/smollm2.gguf
fi
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export OUTPACE_COMMIT=${OUTPACE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "${OUT:-/tmp/out}"
case "$1" in
  tests) # pytest-xdist (carried in .whl/ with execnet) spreads the tests over processes: most
         # of their time is Triton compiling on the CPU, and the machine has 16 cores.
         par=""; python3 -c "import xdist" 2>/dev/null && par="-n 8"
         python3 -m pytest -q $par tests/gpu -p no:cacheprovider 2>&1 \
           | tee "${OUT:-/tmp/out}/gpu_tests.log" | tail -25 ;;
  bench) shift; python3 benchmarks/throughput.py --gguf "$GGUF" \
           --out "${OUT:-/tmp/out}" --sections "$@" ;;
  accuracy) shift; python3 benchmarks/accuracy.py --gguf "$GGUF" \
           --out "${OUT:-/tmp/out}" --sections "$@" ;;
  methods) shift; python3 benchmarks/methods.py --gguf "$GGUF" \
           --out "${OUT:-/tmp/out}/gpu_methods.json" "$@" ;;
  diag)  shift; python3 benchmarks/archive/diag_step.py --gguf "$GGUF" --out "${OUT:-/tmp/out}" "$@" ;;
  rows)  shift; python3 benchmarks/archive/diag_few_rows.py --gguf "$GGUF" --out "${OUT:-/tmp/out}" "$@" ;;
  request) shift; python3 benchmarks/archive/diag_request.py --gguf "$GGUF" --out "${OUT:-/tmp/out}" "$@" ;;
  cublas) shift; python3 benchmarks/archive/diag_cublas_workspace.py --out "${OUT:-/tmp/out}" "$@" ;;
  launch) python3 benchmarks/archive/diag_launch.py --out "${OUT:-/tmp/out}" ;;
  serve) shift; cfgs="$1"; shift; python3 benchmarks/serve.py --start-server "$GGUF" \
           --device cuda --configs "$cfgs" --out "${OUT:-/tmp/out}/gpu_serve_${cfgs//,/_}.json" \
           --log-dir "${OUT:-/tmp/out}/serve_logs" "$@" ;;
  sweep) shift; python3 benchmarks/kernel_speed.py --out "${OUT:-/tmp/out}" \
           --sections sweep --sweep-ms "$1" --sweep-models smol --total-s 45 ;;
esac
