#!/usr/bin/env bash
# The one device call of a session lent a GPU: every GPU measurement and the suite's CUDA cases, in docs/results/gpu.md's
# order of what is least measured first, inside one call's 10 minutes (device `run`, carry [".whl"], timeout_s 600):
#     bash scripts/gpu_lent.sh
# Results: $OUT/gpu.json (saved after each section, so a section cut off by the limit keeps the ones before it) and
# $OUT/log. Extra arguments go to scripts/gpu_static.py (CI: `--smoke ...` on the CPU, OUT a temporary folder).
# The GPU image lacks the server's `greenlet` (the served static case needs it): its wheel travels in .whl, made here by
#     bash scripts/gpu_lent.sh --wheels
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == --wheels ]]; then  # (for the image's Python, 3.12; .whl is git-ignored)
    # (the greenlet installed here; where none is, 3.5.6, the one the server's extra installed when this was written)
    exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        -d .whl "greenlet==$(python3 -c 'import greenlet; print(greenlet.__version__)' 2> /dev/null || echo 3.5.6)"
fi
OUT=${OUT:?"OUT: the folder the results go to (the device call sets it)"}
if compgen -G ".whl/*.whl" > /dev/null && ! python3 -c "import greenlet" 2> /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # speculant from this tree, not installed there
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2> /dev/null | tee "$OUT/device" || true
timeout 570 python3 scripts/gpu_static.py "$OUT/gpu.json" --ab-repeats 5 "$@" 2>&1 | tee "$OUT/log"
