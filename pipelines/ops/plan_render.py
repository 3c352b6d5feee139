"""``pretrain plan``'s text: a ``Plan`` (``pipelines.ops.plan``) as the tables and lines the command prints."""

from __future__ import annotations

from pipelines.ops import plan_constants as K
from pipelines.ops.model_shapes import tokens_per_sample
from pipelines.ops.plan import Plan, duration_text

__all__ = ["render_plan", "render_sources"]


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f}"


def _positions(p: Plan) -> str:
    s = p.shape
    if s.family == "vit":
        return f"{s.image_size} px / patch {s.patch_size} = {tokens_per_sample(s, 0)} tokens per image"
    return f"seq {p.seq_len} (from {p.seq_source}), vocab {s.vocab_size:,}"


def _epochs(t: dict[str, float]) -> str:
    """`` (2.3 epochs of the corpus's 1,140 training samples)``, or "" without one corpus to count."""
    if not t.get("train_samples"):
        return ""
    return f" ({t['epochs']:,.2f} epochs of the corpus's {int(t['train_samples']):,} training samples)"


def render_plan(p: Plan) -> str:
    """The plan as text: the memory table, then checkpoints, failures, throughput, loader, notes and sources."""
    o, gpu, t, c, f = p.options, K.GPU_KINDS[p.options.gpu], p.throughput, p.checkpoint, p.failure
    s = p.shape
    # BERT batches are padded to seq: its rate counts positions, as the MFU measurement does (FLOPs per padded sample)
    unit = {"vit": "images", "bert": "positions"}.get(s.family, "tokens")
    lines = [
        f"plan: {p.config or '(config)'} on {o.gpus} x {gpu.label} ({o.nodes} node(s) x {min(o.gpus, o.gpus_per_node)})",
        f"model {p.model}: {p.params / 1e6:,.1f}M parameters, {s.num_layers} layers x {s.hidden_size}, "
        f"{_positions(p)}; batch {p.global_batch} = micro {p.micro_batch} x accum {p.grad_accum} x {o.gpus} GPUs "
        f"({p.tokens_per_step:,} {unit}/step)",
        "",
        f"memory per GPU, GiB (usable {_gib(p.run_row.limit)} of {_gib(gpu.memory_bytes.value)}):",
        f"  {'ZeRO':<4} {'offload':<16} {'act.ckpt':<8} {'weights':>8} {'grads':>7} {'optim':>7} {'buffers':>8} "
        f"{'activ.':>7} {'total':>7}  fits  CPU/node",
    ]
    for r in p.memory:
        mark = " <- config" if r is p.run_row else ""
        lines.append(f"  {r.stage:<4} {r.offload or '-':<16} {'on' if r.checkpointing else 'off':<8} {_gib(r.weights):>8} "
                     f"{_gib(r.grads):>7} {_gib(r.optimizer):>7} {_gib(r.buffers):>8} {_gib(r.activations):>7} "
                     f"{_gib(r.total):>7}  {'yes ' if r.fits else 'NO  '}  {_gib(r.cpu_per_node) if r.cpu_per_node else '-'}"
                     f"{mark}")
    lines += [
        "",
        f"checkpoint: {c['total'] / 1e9:,.1f} GB = DeepSpeed module {c['module'] / 1e9:,.1f} + optimizer "
        f"{c['optimizer'] / 1e9:,.1f} + world-size-free copy {c['world_free'] / 1e9:,.1f}; keep_last {c['keep_last']} "
        f"-> {c['total'] * (c['keep_last'] + 1) / 1e9:,.0f} GB on disk during a save",
        f"  save {duration_text(c['save_s'])} = write {duration_text(c['write_s'])} at {o.fs_gbps:g} GB/s + rank 0's sha256 "
        f"{duration_text(c['hash_s'])}; resume reads + verifies in {duration_text(c['load_s'])}",
        f"failures: node MTBF {f['node_mtbf_h']:,.0f} h / {o.nodes} node(s) = job MTBF {duration_text(f['job_mtbf_s'])}; restart "
        f"{duration_text(f['restart_s'])}",
        f"  checkpoint every {duration_text(f['daly_s'])} of compute = {max(1, round(f['daly_steps'])):,} steps (Daly 2006; Young "
        f"1974: {duration_text(f['young_s'])}); the config's train.checkpoint_every: {duration_text(f['config_s'])}",
        "",
        f"throughput: MFU {t['mfu']:.1%} x {gpu.bf16_flops.value / 1e12:,.1f} TFLOP/s, {t['flops_per_sample'] / 1e9:,.1f} "
        f"GFLOP/sample -> compute {t['compute_s']:.3f} s/step; communication {t['comm_bytes'] / 1e9:.2f} GB/GPU/step "
        f"-> {t['comm_s']:.3f} s, {t['exposed_comm_s']:.3f} s of it not hidden by the compute; the host's launches "
        f"{t['host_s']:.3f} s/step",
        f"  {t['tokens_s']:,.0f} {unit}/s ({t['tokens_s'] / o.gpus:,.0f} per GPU), {t['step_s']:.3f} s/step",
        f"  budget {p.token_budget:,.0f} {unit} = {t['steps']:,.0f} steps{_epochs(t)}: {duration_text(t['solve_s'])} of compute; with "
        f"checkpoints + failures {duration_text(f['wall_best_s'])} at the optimum interval, {duration_text(f['wall_config_s'])} at the "
        f"config's (Daly's expected wall time)",
        f"loader: {p.loader['cpu_s_per_sample'] * 1e3:.2f} CPU-ms per sample -> {p.loader['cores_per_gpu']:.3f} cores per "
        f"GPU; data.num_workers >= {p.loader['workers']} ({K.LOADER_HEADROOM.value:g}x headroom; config "
        f"{p.loader['config_workers']})",
    ]
    if p.notes:
        lines += ["", "warnings:"] + [f"  - {n}" for n in p.notes]
    lines += ["", "sources (pretrain plan --sources lists every constant):"] + [f"  {s}" for s in p.sources]
    lines.append("  extrapolated: MFU was measured for one model size per family on ONE GPU (each source names it); "
                 "it is applied unchanged to other sizes, GPU kinds (scaled by their peak) and GPU counts; communication "
                 "at datasheet bandwidth.")
    return "\n".join(lines)


def render_sources() -> str:
    """Every constant with its unit and source."""
    return "\n".join(f"{name:<42} {c.value:>14,.6g} {c.unit:<16} {c.source}" for name, c in K.all_constants())
