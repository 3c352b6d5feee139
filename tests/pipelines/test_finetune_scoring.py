"""Scoring an export on every rank (pipelines.finetune.scoring): two real gloo ranks deal out the dev set's
batches and every rank ends with every batch's output, in order, as one process computes them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipelines.engine.distributed import DistEnv
from pipelines.engine.launcher import free_port
from pipelines.finetune.scoring import forward_on_ranks, pack_arrays, unpack_arrays


def _output(batch: int) -> np.ndarray:
    """A batch's "logits": a shape and values of its own (a last short batch, a window width per batch)."""
    rows, width = (3 if batch < 6 else 1), 2 + batch % 4
    return (np.arange(rows * width, dtype=np.float64).reshape(rows, width) * 0.1 + batch).astype(np.float32)


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, launcher="test", device="cpu")
    report = {}
    for count in (7, 1, 0):  # more batches than ranks, fewer (rank 1 runs none), none
        ran: list[int] = []
        out = forward_on_ranks(list(range(count)), lambda b, ran=ran: ran.append(b) or _output(b), env)
        report[count] = {"ran": ran, "out": [o.tolist() for o in out], "dtypes": sorted({str(o.dtype) for o in out})}
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


def test_two_ranks_each_run_every_other_batch_and_both_get_every_output_in_order(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for count in ("7", "1", "0"):
        alone = [_output(b).tolist() for b in range(int(count))]  # what one process computes
        assert [r[count]["ran"] for r in reports] == [list(range(int(count)))[r::2] for r in (0, 1)]
        for r in reports:
            assert r[count]["out"] == alone
            assert r[count]["dtypes"] in ([], ["float32"])


def test_one_process_runs_every_batch_itself():
    ran: list[int] = []
    out = forward_on_ranks([0, 1, 2], lambda b: ran.append(b) or _output(b), None)
    assert ran == [0, 1, 2] and all(np.array_equal(o, _output(b)) for b, o in enumerate(out))


def test_packed_arrays_come_back_bit_for_bit_and_a_damaged_pack_is_refused():
    arrays = [_output(b) for b in range(7)] + [np.zeros((0, 5), np.float32), np.float32([np.nan, -0.0, np.inf])]
    back = unpack_arrays(pack_arrays(arrays))
    assert [a.shape for a in back] == [a.shape for a in arrays]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(arrays, back, strict=True))
    assert unpack_arrays(pack_arrays([])) == []
    with pytest.raises(ValueError, match="4 bytes left over"):
        unpack_arrays(pack_arrays(arrays) + b"\0" * 4)
