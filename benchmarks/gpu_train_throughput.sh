#!/usr/bin/env bash
# Training throughput on one GPU, ours vs the Hugging Face Trainer (benchmarks/train_throughput.py
# --device cuda --precision bf16), on a machine that has torch, transformers and accelerate but not
# this repo's other dependencies (no `make setup`, no internet).
#
# The missing packages travel as wheels in .whl/ at the repo root (git-ignored), the versions of .venv:
#   deepspeed (built here, pure Python: `DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed==X`),
#   its pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions (pydantic's
#   minimum) and hjson, webdataset + braceexpand (the corpus fixtures), mpmath (sympy's, for torch).
# They are installed into $SITE, which goes first on PYTHONPATH; nothing outside it is changed.
#
# Usage, from the repo root:  bash benchmarks/gpu_train_throughput.sh [extra train_throughput.py args, e.g. --compile]
# Output is also written to $OUT/train_throughput.log when $OUT is set. 212 s for the three models on an H200 (2026-11-26).
set -uo pipefail
cd "$(dirname "$0")/.."

SITE=${SITE:-/tmp/site}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# DeepSpeed: CUDA, and never build its ops (our optimizer is torch's AdamW, ZeRO-2 needs no kernels).
export DS_ACCELERATOR=cuda DS_BUILD_OPS=0

LOG=${OUT:+$OUT/train_throughput.log}
LOG=${LOG:-/dev/null}
{
    nvidia-smi -L
    python3 -c 'import sys, torch, transformers, accelerate, deepspeed
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}, accelerate {accelerate.__version__}, deepspeed {deepspeed.__version__}")'
} 2>&1 | tee "$LOG"

# One model per invocation: a failure in one still leaves the other's numbers.
status=0
for model in gpt bert vit; do
    python3 benchmarks/train_throughput.py --device cuda --precision bf16 --models "$model" --steps 40 --warmup 10 \
        --repeats 1 "$@" 2>&1 | tee -a "$LOG" || status=1
done
exit $status
