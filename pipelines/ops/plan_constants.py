"""Every number ``pretrain plan`` uses, with where it comes from (``pretrain plan --sources`` prints them).

Three kinds: our measurements (docs/benchmarks.md: the section, device and date), datasheets and
papers (named), and DeepSpeed's defaults as our engine runs them (``pipelines/engine/distributed.py``
caps the gradient bucket at the model's size and sets no other bucket; a test compares them with the
installed DeepSpeed).
Nothing here is tuned to make a plan look good: where we have no measurement the plan says it
extrapolates, and from which figure.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Constant", "GpuKind", "GPU_KINDS", "MEASURED_MFU", "MFU_MODE", "LOADER_CPU_S_PER_SAMPLE", "CHECKPOINT", "DEEPSPEED",
           "FAILURES", "MEMORY_RESERVE", "LOADER_HEADROOM", "BYTES", "all_constants"]

_BENCH = "docs/benchmarks.md"


@dataclass(frozen=True)
class Constant:
    """A value, its unit and its source (a measurement in docs/benchmarks.md, a datasheet or a paper)."""

    value: float
    unit: str
    source: str


@dataclass(frozen=True)
class GpuKind:
    """One GPU kind from its vendor's datasheet: dense bf16 peak, memory, NVLink and per-GPU network bandwidth."""

    label: str
    bf16_flops: Constant
    memory_bytes: Constant
    nvlink_bytes_s: Constant  # per GPU, one direction
    network_bytes_s: Constant  # per GPU, one direction, between nodes


_H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"
_DGX_H100 = "NVIDIA DGX H100 datasheet: 8 x ConnectX-7 400 Gb/s InfiniBand NDR, one per GPU"
GPU_KINDS: dict[str, GpuKind] = {
    "h100": GpuKind(
        "H100 SXM 80GB",
        Constant(989.5e12, "FLOP/s", f"{_H100_SHEET}: 1,979 TFLOPS bf16 with sparsity = 989.5 dense "
                                     "(monitoring/throughput.py PEAK_FLOPS)"),
        Constant(80 * 2**30, "B", f"{_H100_SHEET}: 80 GB HBM3"),
        Constant(450e9, "B/s", f"{_H100_SHEET}: NVLink 900 GB/s (both directions)"),
        Constant(50e9, "B/s", _DGX_H100),
    ),
    "h200": GpuKind(
        "H200 SXM 141GB",
        Constant(989.5e12, "FLOP/s", "NVIDIA H200 Tensor Core GPU datasheet: 1,979 TFLOPS bf16 with sparsity "
                                     "= 989.5 dense (monitoring/throughput.py PEAK_FLOPS)"),
        Constant(141e9, "B", "NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e"),
        Constant(450e9, "B/s", "NVIDIA H200 datasheet: NVLink 900 GB/s (both directions)"),
        Constant(50e9, "B/s", "NVIDIA DGX H200 datasheet: 8 x ConnectX-7 400 Gb/s, one per GPU"),
    ),
    "a100": GpuKind(
        "A100 SXM 80GB",
        Constant(312e12, "FLOP/s", "NVIDIA A100 Tensor Core GPU datasheet: bf16 312 TFLOPS dense"),
        Constant(80 * 2**30, "B", "NVIDIA A100 datasheet: 80 GB HBM2e"),
        Constant(300e9, "B/s", "NVIDIA A100 datasheet: NVLink 600 GB/s (both directions)"),
        Constant(25e9, "B/s", "NVIDIA DGX A100 datasheet: 8 x ConnectX-6 200 Gb/s HDR, one per GPU"),
    ),
}

#: Model FLOPs utilisation of a whole training run (engine + loader), by family: the latest run of each recipe
#: as a user runs it on ONE GPU (each source names the card; MFU is taken as a share of the card's peak).
MEASURED_MFU: dict[str, Constant] = {
    "gpt": Constant(0.344, "of peak", f"{_BENCH} gpu_check: GPT-2 124M, gpt2_small.yaml as shipped (torch.compile, "
                                      "DeepSpeed ZeRO-2, bf16, micro-batch 16 x 1024, one micro-batch a step), 1 x H100, "
                                      "2026-11-27: 414,224 tokens/s = 34.4 % of 989.5 TFLOP/s"),
    "gpt-eager": Constant(0.162, "of peak", f"{_BENCH} train_throughput (GPU): GPT-2 124M, gpt2_small.yaml with "
                                            "model.compile=false, 32 x 1024, DeepSpeed ZeRO-2, 1 x H200, 2026-11-26: "
                                            "187,632 tokens/s = 16.2 %"),
    "bert": Constant(0.242, "of peak", f"{_BENCH} train_throughput (GPU): BERT-base, bert_base_phase1.yaml, "
                                       "256 x 128, eager, 1 x H200, 2026-11-26: 233,927 tokens/s = 24.2 % (the MFU counts "
                                       "FLOPs per padded 128-position sample; the tokens/s counts unpadded tokens; the "
                                       "compiled recipe is measured at 32 x 128 only, bound by kernel launches there)"),
    "vit": Constant(0.279, "of peak", f"{_BENCH} gpu_check: ViT-B/16, vit_b16.yaml as shipped (torch.compile, DeepSpeed "
                                      "ZeRO-2, bf16, 128 x 224 px) on a raw-pixel corpus, 1 x H100, 2026-11-27: 2,616 "
                                      "images/s = 27.9 %, data wait 0.8 %"),
}

#: The host's share of a step: a micro-batch's forward and backward cannot take less than the host needs to launch
#: their kernels, whatever the arithmetic (a small model, or a small micro batch, is bound by it).
HOST_S_PER_LAYER = Constant(24.2e-3 / 12, "s per layer per micro-batch", f"{_BENCH} gpu_check: BERT-base's bare "
                            "compiled step at micro-batch 32 x 128 (forward, backward, fused AdamW), 1 x H100, "
                            "2026-11-27: 24.2 ms with the device busy 9.6 ms of it, so set by the host's launches: "
                            "24.2 ms / 12 layers")

#: Which run each MFU figure comes from (``plan`` prints it beside the figure).
MFU_MODE = {"gpt": "compiled", "gpt-eager": "eager", "bert": "eager", "vit": "compiled"}

#: Loader worker CPU-seconds per sample, by corpus kind (the worker's decode + collate).
LOADER_CPU_S_PER_SAMPLE: dict[str, Constant] = {
    "text": Constant(2 / 32470 / 129, "CPU-s per token", f"{_BENCH} loader_throughput: 2 workers on 2 cores read "
                     "32,470 samples/s of 129-token packed_lm windows (1 GB corpus, idle 2-core VM, 2026-11-26) = "
                     "61.6 µs per window, taken per token (0.48 µs) for other lengths"),
    "images-raw": Constant(0.160e-3, "CPU-s per image", f"{_BENCH} image_decode: a raw-pixel corpus (images.format=raw, "
                           "224 px uint8), read + collate with the crop box and flip drawn, 0.160 CPU-ms per image "
                           "(busy 2-core VM, 2026-11-26); the resize and normalisation run on the GPU"),
    "images-encoded": Constant(2.701e-3, "CPU-s per image", f"{_BENCH} image_decode: a PNG corpus at 256 px, decode + "
                               "random-resized crop + normalise in the worker, 2.701 CPU-ms per image (JPEG q90: 1.768; "
                               "busy 2-core VM, 2026-11-26)"),
}

#: Checkpoint save costs beyond the filesystem's bandwidth.
CHECKPOINT: dict[str, Constant] = {
    "sha256_bytes_s": Constant(0.59e9, "B/s", f"{_BENCH} checkpoint_hash: core.files.sha256_file on one core of the "
                                             "2-core VM (Xeon with SHA-NI), 1 GiB from the page cache, best of 3, "
                                             "2026-11-26, machine BUSY (load 9): rank 0 hashes every file of a save"),
    "world_free_bytes_per_param_per_state": Constant(4, "B", "pipelines/engine/reshard.py: fp32 master + each "
                                                     "per-element optimizer state, 4 B each (Adam: 12 B/param)"),
}

#: DeepSpeed's ZeRO defaults (deepspeed/runtime/zero/config.py, 0.19.8); our config sets none of them.
DEEPSPEED: dict[str, Constant] = {
    "reduce_bucket_size": Constant(5e8, "elements", "DeepSpeedZeroConfig.reduce_bucket_size default (5e8)"),
    "allgather_bucket_size": Constant(5e8, "elements", "DeepSpeedZeroConfig.allgather_bucket_size default (5e8)"),
    "zero3_prefetch_bucket_size": Constant(5e7, "elements", "DeepSpeedZeroConfig.prefetch_bucket_size default (5e7)"),
    "offload_cpu_buffer_factor": Constant(1.5, "x", "deepspeed estimate_zero{2,3}_model_states_mem_needs "
                                                    "additional_buffer_factor default"),
}

#: Failure rates and restart cost when the user gives none.
FAILURES: dict[str, Constant] = {
    "node_mtbf_hours": Constant(6335.0, "h", "Llama 3 (Dubey et al. 2024, Sec. 3.3.4): 419 unexpected interruptions in "
                                             "54 days on 16,384 H100s = 2,048 nodes of 8 -> 54 x 24 x 2048 / 419 "
                                             "node-hours per failure"),
    "restart_minutes": Constant(10.0, "min", "assumption, not measured: SLURM requeue + process start + rendezvous "
                                             "(tests/slurm requeue in ~10 s on a 2-node CPU cluster); give "
                                             "--restart-minutes from your cluster"),
}

LOADER_HEADROOM = Constant(2.0, "x", "assumption, not measured: loader workers per GPU = 2 x the CPU cores its samples "
                                     "need, so a slow shard read or GC pause does not starve the step")

MEMORY_RESERVE = Constant(0.10, "of GPU memory", "assumption, not measured: CUDA context, NCCL buffers and caching-"
                                                 "allocator fragmentation; 'fits' needs the estimate <= 90 % of memory")

#: Bytes per element by precision for (weights, gradients, activations) as the engines keep them.
BYTES: dict[str, Constant] = {
    "bf16": Constant(2, "B", "DeepSpeed bf16 mode casts the model to bf16 (pipelines/engine/distributed.py)"),
    "fp16": Constant(2, "B", "DeepSpeed fp16 mode casts the model to fp16"),
    "fp32": Constant(4, "B", "fp32"),
}


def all_constants() -> list[tuple[str, Constant]]:
    """Every constant by a dotted name, for ``pretrain plan --sources``."""
    out: list[tuple[str, Constant]] = []
    for kind, gpu in GPU_KINDS.items():
        for field in ("bf16_flops", "memory_bytes", "nvlink_bytes_s", "network_bytes_s"):
            out.append((f"gpu.{kind}.{field}", getattr(gpu, field)))
    for prefix, table in (("mfu", MEASURED_MFU), ("loader", LOADER_CPU_S_PER_SAMPLE), ("checkpoint", CHECKPOINT),
                          ("deepspeed", DEEPSPEED), ("failures", FAILURES), ("bytes", BYTES)):
        out.extend((f"{prefix}.{k}", c) for k, c in table.items())
    out.append(("memory_reserve", MEMORY_RESERVE))
    out.append(("loader_headroom", LOADER_HEADROOM))
    return out
