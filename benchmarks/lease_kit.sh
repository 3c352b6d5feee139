#!/usr/bin/env bash
# What a GPU lease carries, made here on the CPU machine before the first device call (device time is
# minutes; this takes about a minute of the session's on an idle 2-core VM):
#   .whl/        the Python packages the GPU image lacks (it has torch, transformers and accelerate), as
#                wheels for its Python: deepspeed (pure Python, built with DS_BUILD_OPS=0), pydantic and
#                pydantic-core (binary, for GPU_PYTHON), annotated-types, typing-inspection, typing-extensions
#                (pydantic's minimum), hjson, webdataset + braceexpand (warmup_map_gpu.sh); each at the version
#                of this environment, which the tests ran with. benchmarks/gpu_env.sh installs them there.
#   .gpu_check/  the corpora of benchmarks/gpu_check.py, made with our own `pretrain prepare` (needs Ray).
# Each part is skipped when it is already there. Both are git-ignored; the device tool carries them:
#   run(carry=[".whl", ".gpu_check"], command="OUT=$OUT bash benchmarks/gpu_check.sh ...")
#
# Usage, from a set-up checkout (`make setup`):  bash benchmarks/lease_kit.sh
#   PYTHON (default .venv/bin/python), GPU_PYTHON (default 3.12: the GPU image's, docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
GPU_PYTHON=${GPU_PYTHON:-3.12}
PURE=(pydantic annotated-types typing-inspection typing-extensions hjson webdataset braceexpand)

pin() { $PY -c "import importlib.metadata as m, sys; print(f'{sys.argv[1]}=={m.version(sys.argv[1])}')" "$1"; }

mkdir -p .whl
if ! compgen -G ".whl/deepspeed-*.whl" >/dev/null; then
    DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation "$(pin deepspeed)" -w .whl
fi
pins=()
for pkg in "${PURE[@]}"; do pins+=("$(pin "$pkg")"); done
$PY -m pip download -q --no-deps --only-binary=:all: -d .whl "${pins[@]}"
$PY -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$GPU_PYTHON" \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$(pin pydantic-core)"
ls .whl

$PY benchmarks/gpu_check.py prepare --out .gpu_check  # skips each corpus already prepared
du -sh .whl .gpu_check
