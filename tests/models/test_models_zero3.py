"""ZeRO-3 wraps our models: parameters are only whole inside forward (one CPU process, gloo)."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import torch, deepspeed, models
    torch.distributed.init_process_group("gloo")
    tiny = dict(num_layers=2, hidden_size=32, num_heads=2, intermediate_size=64, hidden_dropout=0.0, attention_dropout=0.0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True}}}
    g = torch.Generator().manual_seed(0)
    batches = {
        "bert-tiny": dict(input_ids=(ids := torch.randint(1, 64, (2, 8), generator=g)), attention_mask=torch.ones_like(ids),
                          labels=ids, next_sentence_label=torch.tensor([0, 1])),
        "gpt-tiny": dict(input_ids=ids, labels=ids),
        "vit-tiny": dict(pixel_values=torch.randn(2, 3, 8, 8, generator=g), labels=torch.tensor([0, 1])),
    }
    for name, batch in batches.items():
        extra = dict(image_size=8, patch_size=4, num_labels=3) if name.startswith("vit") else dict(vocab_size=64, max_position_embeddings=16)
        model = models.create(name, **tiny, **extra)
        model.set_activation_checkpointing(True)
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        losses = []
        for _ in range(15):
            loss = engine(**batch)["loss"]
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert losses[-1] < 0.7 * losses[0], (name, losses)
        print("OK", name, losses[0], losses[-1])
    """
)


@pytest.mark.slow
def test_zero3_trains_every_family(tmp_path):
    pytest.importorskip("deepspeed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    script = tmp_path / "zero3.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("OK") == 3
