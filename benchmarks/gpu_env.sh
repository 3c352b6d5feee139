# Sourced by the GPU scripts (gpu_check.sh, warmup_map_gpu.sh) from the repository root: sets PY and makes
# the packages the GPU image lacks importable from the wheels in .whl/ (how to build them:
# benchmarks/gpu_train_throughput.sh). GPU_NEEDS: the imports that must work (default: deepspeed).
# A set-up machine runs the scripts with PYTHON=.venv/bin/python and installs nothing.
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
if ! $PY -c "import ${GPU_NEEDS:-deepspeed}" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export PYTHONUNBUFFERED=1
