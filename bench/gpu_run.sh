#!/usr/bin/env bash
# The GPU check on a lent GPU machine: `bash bench/gpu_run.sh [gpu_check options]`, with the bundle of
# `make gpu-bundle` carried (.gpu). That machine reaches no registry and has its own Python and torch:
# the bundle's wheels go into a target folder ahead of the image's packages, its valkey-server serves
# the Redis part, and results go to $OUT (the device tool's folder), else results/gpu.
#
# RKV_GPU_BUNDLE, RKV_GPU_PYTHON, RKV_GPU_PIP and RKV_GPU_SITE change the bundle's folder, the
# interpreter, pip and the target folder (the rehearsal on a CPU machine sets them).
set -uo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${RKV_GPU_BUNDLE:-.gpu}
PYTHON=${RKV_GPU_PYTHON:-python3}
PIP=${RKV_GPU_PIP:-"$PYTHON -m pip"}
SITE=${RKV_GPU_SITE:-/tmp/rkv-gpu-site}
RESULTS=${OUT:-results/gpu}

if [ ! -f "$BUNDLE/wheels.txt" ]; then
  echo "gpu run: no bundle at $BUNDLE (make gpu-bundle builds it; carry it with the run)" >&2
  exit 3
fi
while read -r prefix dist; do
  if ! compgen -G "$BUNDLE/wheels/${prefix}-*.whl" >/dev/null; then
    echo "gpu run: the bundle lacks the wheel of $dist ($BUNDLE/wheels/${prefix}-*.whl): make gpu-bundle again" >&2
    exit 3
  fi
done <"$BUNDLE/wheels.txt"

$PIP install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$BUNDLE"/wheels/*.whl \
  || { echo "gpu run: installing the bundle's wheels failed" >&2; exit 4; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
# The tree came without .git: results name the commit the bundle was made at (bench/provenance.py).
if [ -s "$BUNDLE/commit.txt" ]; then export RKV_SOURCE_COMMIT="$(cat "$BUNDLE/commit.txt")"; fi
if [ -x "$BUNDLE/bin/valkey-server" ]; then export RKV_REDIS_SERVER="$(cd "$BUNDLE/bin" && pwd)/valkey-server"; fi

# Whatever the image and the bundle lack shows here, by name, before any part starts.
if ! problem=$($PYTHON -c "import bench.gpu_check" 2>&1); then
  echo "gpu run: the check cannot import what it needs: $(echo "$problem" | tail -n 1)" >&2
  exit 5
fi
mkdir -p "$RESULTS"
exec $PYTHON -m bench.gpu_check --out "$RESULTS" "$@"
