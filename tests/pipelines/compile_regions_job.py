"""One rank of a 2-rank world (``torchrun --nproc_per_node 2``, gloo): the engine as a run builds it (DeepSpeed
ZeRO-2, ``model.compile``, a 4-layer tiny GPT, gradient buckets of about a block each), once per
``model.compile_regions`` (``model``: one graph; ``blocks``: one graph per block; ``auto`` where a DeepSpeed JSON
sets ``overlap_comm``: blocks), trained a few steps on this rank's
own batches, then one backward profiled as ``benchmarks/comm_overlap.py`` profiles it.

    torchrun --nproc_per_node 2 compile_regions_job.py OUT.json     # writes OUT.rank-N.json

Per case: the losses, the compiled autograd nodes of one backward, and the bucket reductions of one backward with
how many of them started while it still computed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks"), str(Path(__file__).parent)]

STEPS, LAYERS = 3, 4


def run(regions: str, bucket_json: Path, rank: int) -> dict:
    from accelerate.state import AcceleratorState, GradientState
    from comm_overlap import VOCAB, overlapped
    from test_compile_regions import backward_nodes

    import models
    from core.config import load_config
    from pipelines.engine import distributed as dist
    from pipelines.engine import engines
    from pipelines.engine.config import RunConfig
    from pipelines.engine.optim import build_optimizer

    AcceleratorState._reset_state()  # one accelerate state per process: each case builds its own
    GradientState._reset_state()
    torch._dynamo.reset()
    cfg = load_config(REPO / "configs/train/gpt_tiny_cpu.yaml", [
        "distributed.engine=deepspeed", "distributed.zero_stage=2", "train.precision=fp32", "model.compile=true",
        f"model.compile_regions={regions}", f"distributed.deepspeed_config={bucket_json}",
        "distributed.timeout_minutes=2"], cls=RunConfig)  # a mismatch between the ranks fails, not hangs
    env = dist.init_env()
    torch.manual_seed(0)
    model = models.create("gpt-tiny", vocab_size=VOCAB, num_layers=LAYERS, hidden_dropout=0.0, attention_dropout=0.0)
    engine = engines.build_engine(cfg, env, model, build_optimizer(model, cfg.optim), lambda step: 1.0)
    engine.train()
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (4, 64), generator=g)
        loss = engine(input_ids=ids, labels=ids)["loss"]
        losses.append(float(loss.detach()))
        engine.backward(loss)
        engine.step()
    nodes = backward_nodes(engine(input_ids=ids, labels=ids)["loss"])["CompiledFunctionBackward"]
    total, early = overlapped(lambda **batch: engine(**batch), engine.backward)
    return {"losses": losses, "compiled_nodes": nodes, "collectives": total, "started_during_backward": early}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        # buckets of about one block's gradients (the model has ~1.8 M); auto splits where DeepSpeed overlaps, which
        # on the CPU only a JSON's overlap_comm turns on
        for regions, overlap in (("model", {}), ("blocks", {}), ("auto", {"overlap_comm": True})):
            ds_json = Path(tmp) / f"ds-{regions}.json"
            ds_json.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 200_000, **overlap}}))
            results[regions] = run(regions, ds_json, rank)
    out.with_suffix(f".rank-{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
