#!/usr/bin/env bash
# ferry's CUDA checks in one run, for a GPU machine with CUDA torch but no package index
# (README, "Running the CUDA tests"). Needs, beside the working tree: .whl/ from
# `python scripts/device_kit.py download` and the generated services/common/gen/.
# Writes cuda-tests.log, migration_speed_gpu.tsv and .png under $OUT (or /tmp/ferry-device).
# Bounded to 500 s in all (tests 360 s, benchmark 120 s, 10 s each to die), so that one device
# command (600 s at most) still brings the log back after the machine's start and copies.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/ferry-device}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/ failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -f services/common/gen/ferry/v1/transfer_pb2.py ] || { echo "carry services/common/gen (make proto)"; exit 1; }
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'cuda devices:', torch.cuda.device_count())"

timeout -k 10 360 python3 -m pytest -q -m cuda -p no:cacheprovider -rs --durations=10 \
    tests/unit/instance/test_cuda_ipc.py tests/unit/instance/test_engine_cuda.py \
    tests/integration/test_transfer.py tests/e2e/test_cuda_e2e.py 2>&1 | tee "$out/cuda-tests.log"
tests=${PIPESTATUS[0]}

timeout -k 10 120 python3 benchmarks/migration_speed.py --kv-device cuda --max-mb 256 --repeats 3 --layouts scattered \
    --out-dir "$out/bench" 2>&1 | grep -v "it/s\]$" | tee "$out/migration-speed.log"
cp "$out/bench/results.tsv" "$out/migration_speed_gpu.tsv" 2>/dev/null
cp "$out/bench/migration_speed.png" "$out/migration_speed_gpu.png" 2>/dev/null
rm -rf "$out/bench"
echo "device_check: ${SECONDS} s, tests exit status ${tests}"
exit "$tests"
