#!/usr/bin/env bash
# Issue #30's GPU check: the three GPU recipes run as users run them (torchrun ... -m pipelines.pretrain
# configs/train/gpu/...), DeepSpeed ZeRO-2 and DDP, plus the bare step, in one table (benchmarks/gpu_check.py).
#
# On a machine that has torch, transformers and accelerate but not this repo's other dependencies:
# the missing ones travel as wheels in .whl/ (git-ignored; see gpu_train_throughput.sh for the list and
# how to build deepspeed's), the corpora in .gpu_check/ (git-ignored), prepared beforehand on a CPU machine
# with Ray, since Ray is not on the GPU image:
#
#   python benchmarks/gpu_check.py prepare                 # here: ~20 MB, with our own `pretrain prepare`
#   bash benchmarks/gpu_check.sh                           # there: installs .whl/, prints the table
#   PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh --cpu-smoke --corpora /tmp/gc --steps 6
#     # anywhere: the same pipeline on the tiny CPU configs, after `gpu_check.py prepare --cpu-smoke --out /tmp/gc`
#
# Extra arguments go to `gpu_check.py run` (--recipes gpt,bert --engines deepspeed,ddp,zero0,zero1,zero3 --steps N
# --no-bare --set model.compile=true).
# The table is also written to $OUT/gpu_check.md (+ gpu_check.json) when $OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."

source benchmarks/gpu_env.sh  # PY; the wheels of .whl/ where a package is missing
# DeepSpeed: never build its ops (the optimizer is torch's fused AdamW, ZeRO-2 needs no kernels).
export DS_BUILD_OPS=0

command -v nvidia-smi >/dev/null && nvidia-smi -L
$PY -c 'import sys, torch, transformers, accelerate, deepspeed
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}, accelerate {accelerate.__version__}, deepspeed {deepspeed.__version__}")'
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    $PY benchmarks/gpu_check.py run --json "$OUT/gpu_check.json" "$@" 2>&1 | tee "$OUT/gpu_check.log"
    status=${PIPESTATUS[0]}
    awk '/^## gpu_check/{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}' "$OUT/gpu_check.log" | grep -E '^(##|\|)' > "$OUT/gpu_check.md"
    exit "$status"
fi
exec $PY benchmarks/gpu_check.py run "$@"
