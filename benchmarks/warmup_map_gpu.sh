#!/usr/bin/env bash
# Issue #33's GPU map: the whole of configs/sweeps/warmup_map_literature.yaml plus 24-layer stacks
# (4 arms x 2 beta2 x 3 stacks x 3 depths x 4 lrs x 3 seeds = 864 runs of 300 steps) on one GPU, as ensembles
# (`ensemble=N`, pipelines/study/ensemble.py): the 96 runs of one stack and depth -- they differ only in
# optimizer, lr, beta2, warmup and seed -- train as one batched model in one process, so the GPU does 96 runs'
# work per kernel instead of idling between the launches of one small run. Into the sweep directory
# `pretrain report` reads; then the report (map table printed, figures in SWEEP_DIR/study).
#
#   bash benchmarks/warmup_map_gpu.sh                      # on the GPU machine (<= MINUTES, default 8)
#   PYTHON=.venv/bin/python bash benchmarks/warmup_map_gpu.sh --cpu-tiny   # anywhere: the same pipeline,
#                                                          # a tiny grid on the CPU (what tests run)
# Options: --cpu-tiny, --ensemble N (members per ensemble, default 96; 0 = one run at a time), --shards N
# (processes on the GPU, each with its share of the grid: default 1 with ensembles, 12 without), --minutes M
# (default 8: then every process gets SIGTERM; an ensemble stops at its next step and is rerun whole by the
# next invocation, a single run saves a checkpoint and resumes; runs are seed-major, so whole seeds finish
# first), --out DIR; anything else is a sweep override (e.g. 'seeds=[0,1]'). The corpus (CORPUS, default
# demo_out/corpus_lit_gpt; ~2 MB) is prepared here with `pretrain prepare` (see the config's header) and
# travels with the repo (Ray is not on the GPU image); missing Python packages travel as wheels in .whl/ as
# for benchmarks/gpu_check.sh. Through the device tool: carry [".whl", "demo_out/corpus_lit_gpt",
# "runs/sweeps/warmup_map_literature.packed"], command `OUT=$OUT bash benchmarks/warmup_map_gpu.sh`,
# timeout_s 570; back in $OUT come the map table, shard 0's log and
# warmup_map_runs.tar.xz.NN: every finished run (the carried ones too; metrics with the early histograms
# only, configs, `done` markers; benchmarks/warmup_map_pack.py), ~22 KB a run. Copied here into
# runs/sweeps/warmup_map_literature.packed/ (replacing what was there), they travel with the next call, which
# unpacks them first and skips those runs: the grid fills up over several lent sessions. Unpacked here
# (`cat warmup_map_runs.tar.xz.* | tar xJf - -C runs/sweeps`), `pretrain report` reads them.
#
# Without ensembles the shards share the GPU through MPS where the machine has it (nvidia-cuda-mps-control;
# checked with a probe, else plain time-slicing). Measured that way without MPS (H100, 2026-11-26): 12 shards
# of tiny launch-bound runs time-sliced the GPU at 0.29 s per step each, ~41 steps/s in all: 7 runs of 300
# steps in 3 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."

GPU_NEEDS="deepspeed, webdataset" source benchmarks/gpu_env.sh  # PY; the wheels of .whl/ where a package is missing
export DS_BUILD_OPS=0  # DeepSpeed (imported, unused by the ddp engine) never builds its ops

SWEEP=configs/sweeps/warmup_map_literature.yaml
CORPUS=${CORPUS:-demo_out/corpus_lit_gpt}
MODE=gpu SHARDS="" MINUTES=8 SWEEP_DIR="" OVERRIDES=() ENSEMBLE=""
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu-tiny) MODE=cpu ;;
        --shards) SHARDS=$2; shift ;;
        --ensemble) ENSEMBLE=$2; shift ;;
        --minutes) MINUTES=$2; shift ;;
        --out) SWEEP_DIR=$2; shift ;;
        *) OVERRIDES+=("$1") ;;
    esac
    shift
done

if [ "$MODE" = cpu ]; then  # the same grid machinery and report, sized for a CPU test: 12 runs of 4 steps
    export CUDA_VISIBLE_DEVICES=""
    ENSEMBLE=${ENSEMBLE:-4}
    SHARDS=${SHARDS:-2}
    SWEEP_DIR=${SWEEP_DIR:-runs/sweeps/warmup_map_literature_tiny}
    GRID=("lrs=[1e-3]" "seeds=[0,1]" "only=[adam-none,adam-linear]" 'keep=["*-L2", "adam-none-*"]'
          'axes.depth={L1: [model.overrides.num_layers=1], L2: [model.overrides.num_layers=2]}'
          'axes.norm={post: [model.overrides.norm_placement=post, model.overrides.init=standard]}')
    SETS=(--set model.overrides.hidden_size=32 --set model.overrides.intermediate_size=64
          --set train.max_steps=4 --set train.eval_every=4 --set train.eval_batches=1 --set train.log_every=1
          --set logging.diagnostics_every=2 --set data.micro_batch_size=4)
else
    ENSEMBLE=${ENSEMBLE:-96}
    if [ "$ENSEMBLE" -gt 1 ]; then SHARDS=${SHARDS:-1}; else SHARDS=${SHARDS:-12}; fi
    SWEEP_DIR=${SWEEP_DIR:-runs/sweeps/warmup_map_literature}
    GRID=('axes.depth={L6: [model.overrides.num_layers=6], L12: [model.overrides.num_layers=12], L24: [model.overrides.num_layers=24]}')
    SETS=()
    command -v nvidia-smi >/dev/null && nvidia-smi -L
fi
if [ ! -f "$CORPUS/manifest.json" ]; then
    echo "error: $CORPUS/manifest.json is missing. Prepare the corpus first (Ray runs on the CPU machine):" >&2
    echo "  pretrain prepare configs/data/gpt_packed.yaml output=$CORPUS seq_len=64 tokenizer.vocab_size=4096 shard_target_mb=1" >&2
    echo "and carry it along (or set CORPUS=DIR)." >&2
    exit 2
fi
ARGS=("$SWEEP" "corpus=$CORPUS" "out_dir=$SWEEP_DIR" "jobs=1" "threads=1" "ensemble=$ENSEMBLE" "${GRID[@]}" "${OVERRIDES[@]}")
listing=$($PY -m pipelines.study.sweep list "${ARGS[@]}") || exit 2   # a bad override fails here, before any run
total=$(printf '%s\n' "$listing" | wc -l)
echo "warmup map: $total runs, ensembles of <= $ENSEMBLE, $SHARDS shards, mode $MODE, at most $MINUTES min, into $SWEEP_DIR"

start_mps() {  # MPS: kernels of the shards' processes run side by side instead of in turns
    local ctl
    ctl=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control 2>/dev/null) || return 1
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if timeout 60 "$ctl" -d && timeout 90 $PY -c 'import torch; torch.ones(1, device="cuda").sum().item()' 2>/dev/null; then
        MPS_CTL=$ctl
        return 0
    fi
    echo quit | timeout 30 "$ctl" 2>/dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    return 1
}
MPS_CTL=""
if [ "$MODE" = gpu ] && [ "$SHARDS" -gt 1 ]; then
    if start_mps; then echo "warmup map: the shards share the GPU through MPS ($MPS_CTL)"
    else echo "warmup map: no MPS on this machine; the shards time-slice the GPU"; fi
fi
if ls "$SWEEP_DIR".packed/warmup_map_runs.tar.xz.* >/dev/null 2>&1; then  # an earlier call's runs, carried packed
    mkdir -p "$(dirname "$SWEEP_DIR")"
    cat "$SWEEP_DIR".packed/warmup_map_runs.tar.xz.* | tar xJf - -C "$(dirname "$SWEEP_DIR")" --skip-old-files
fi
runs_before=$(find "$SWEEP_DIR/runs" -name done 2>/dev/null | wc -l)

start=$(date +%s)
mkdir -p "$SWEEP_DIR.logs"
pids=()
for ((i = 0; i < SHARDS; i++)); do
    timeout -s TERM -k 60 "$((MINUTES * 60))" \
        $PY -m pipelines.study.sweep local "${ARGS[@]}" "${SETS[@]}" --shard "$i/$SHARDS" > "$SWEEP_DIR.logs/shard-$i.log" 2>&1 &
    pids+=($!)
    if [ "$i" = 0 ]; then  # shard 0 claims SWEEP_DIR and writes sweep.json before the others start
        for _ in $(seq 120); do [ -f "$SWEEP_DIR/sweep.json" ] && break; sleep 1; done
    fi
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
wall=$(( $(date +%s) - start ))
[ -n "$MPS_CTL" ] && echo quit | timeout 30 "$MPS_CTL"
done_runs=$(find "$SWEEP_DIR/runs" -name done 2>/dev/null | wc -l)
steps=$(grep -ho 'max_steps: [0-9]*' "$SWEEP_DIR"/runs/*/config.yaml 2>/dev/null | head -n 1 | grep -o '[0-9]*$')
echo "warmup map: $done_runs / $total runs done ($runs_before before this call), $((done_runs - runs_before)) in ${wall}s wall" \
     "($SHARDS shards; $failed shards stopped early or failed; ~$(( (done_runs - runs_before) * ${steps:-0} / (wall > 0 ? wall : 1) )) steps/s in all)"
$PY -m pipelines.cli report "$SWEEP_DIR" | tee "$SWEEP_DIR.logs/report.log"
status=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
    cp "$SWEEP_DIR/study/map_table.md" "$OUT/" 2>/dev/null  # the summary and figures: `pretrain report` here, from the packed runs (8 files come back at most)
    tail -n 40 "$SWEEP_DIR.logs/shard-0.log" > "$OUT/shard-0.log"
    # the finished runs, small (benchmarks/warmup_map_pack.py: early histograms only, xz), to carry into the next call
    $PY benchmarks/warmup_map_pack.py "$SWEEP_DIR" "$OUT"
fi
[ "$status" = 0 ] && [ "$done_runs" = "$total" ] && exit 0
[ "$status" = 0 ] && exit 3   # the report is written, the grid is not complete: run the script again
exit "$status"
