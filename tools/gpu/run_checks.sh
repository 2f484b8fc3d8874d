#!/bin/bash
# What needs a GPU, in one go: bash tools/gpu/run_checks.sh [SECTION...]
#   kernels     the CUDA kernels against the PyTorch reference (tests marked cuda)
#   tests       the engine on the GPU: CUDA graphs against eager, cuda against torch backend
#   split       where a batch-64 decode step's time goes (graphs and eager, the sampler synced or not)
#   latency     one request, engine (CUDA graphs, then eager) against HF generate
#   throughput  the benchmark workload in float16 against HF generate_batch and static
#   v1          the same workload on V1 (CUDA graphs, then eager, alternated), HF at batch 64 only,
#               then where a V1 batch-64 decode step's time goes (step_split --v1)
#   v1mp        v1 with V1's engine core in a process of its own (MINIVLLM_ENABLE_V1_MULTIPROCESSING=1,
#               vLLM's default for LLM), so that output processing overlaps the next step
# (default: kernels tests v1 split latency, about 8 minutes: the classic engine's throughput ran
# on two GPUs already, V1 on none; throughput and v1mp when time allows). Logs and JSON results
# go to $OUT (default /tmp/minivllm-gpu);
# $THROUGHPUT_ARGS replaces the throughput run's --repeats 3 (three, so that the median drops
# HF's first static run, which on an H100 took about ten times its later ones).
# Wheels in .whl/ are installed first, for a machine that reaches no package index. The lent
# H200 (2026-11-28) lacked pyzmq and msgspec (V1) and had transformers 5.17; fetch them here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     pyzmq msgspec transformers==5.24.0
# and carry .whl (echo /.whl/ >> .git/info/exclude).
set -u
OUT=${OUT:-/tmp/minivllm-gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/reference_impl:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, cupy
print('torch', torch.__version__, '| transformers', transformers.__version__, '| cupy', cupy.__version__)"

PYTEST=(python3 -m pytest -o addopts= -p no:cacheprovider -q -m cuda -W ignore::DeprecationWarning)
section() { echo "== $1 ($(date +%T))"; }
for name in "${@:-kernels tests v1 split latency}"; do for s in $name; do
    case $s in
    kernels)  # in parallel: NVRTC compiles each instantiation once per process
        section kernels
        timeout 240 "${PYTEST[@]}" -n 8 -k "not engine" tests/test_attention_kernels_cuda.py \
            2>&1 | tee "$OUT/kernels.log" | tail -4 ;;
    tests)  # one engine at a time: each takes gpu_memory_utilization of the card
        section tests
        timeout 240 "${PYTEST[@]}" -k "engine or graph" tests/test_attention_kernels_cuda.py \
            tests/test_cuda_graphs.py 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    split)
        section split
        timeout 120 python3 -m tools.bench.step_split --device cuda 2>&1 | tee "$OUT/split.log" | tail -8 ;;
    latency)
        section latency
        for eager in "" --enforce-eager; do
            timeout 150 python3 -m tools.bench.latency --single-only --device cuda $eager \
                --json "$OUT/latency${eager:+_eager}.json" 2>&1 | tail -12
        done ;;
    throughput)
        section throughput
        timeout 400 python3 -m tools.bench.throughput --device cuda --dtype float16 \
            ${THROUGHPUT_ARGS:---repeats 3} --no-plot --json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log" | tail -45 ;;
    v1)
        section v1
        timeout 300 python3 -m tools.bench.throughput --device cuda --dtype float16 --v1 \
            --repeats 2 --hf-cb-batch-sizes 64 --no-plot --json "$OUT/throughput_v1.json" \
            2>&1 | tee "$OUT/throughput_v1.log" | tail -30
        timeout 120 python3 -m tools.bench.step_split --device cuda --v1 2>&1 \
            | tee "$OUT/split_v1.log" | tail -8 ;;
    v1mp)
        section v1mp
        MINIVLLM_ENABLE_V1_MULTIPROCESSING=1 timeout 300 python3 -m tools.bench.throughput \
            --device cuda --dtype float16 --v1 --repeats 2 --hf-cb-batch-sizes 64 --no-plot \
            --json "$OUT/throughput_v1mp.json" 2>&1 | tee "$OUT/throughput_v1mp.log" | tail -30 ;;
    *) echo "unknown section $s"; exit 2 ;;
    esac
done; done
section done
