"""One rank of a 2-rank DeepSpeed world (``torchrun --nproc_per_node 2``, gloo): each ZeRO-1/2 case trained with
DeepSpeed's own step and with ``zero_step``'s (``zero_train.train``; rank 1's token-embedding gradient made NaN at
one step), compared here.

    torchrun --nproc_per_node 2 zero_step_job.py OUT.json     # writes OUT.rank-N.json

Per case: the patches installed, the skipped steps of both runs, whether the norms and every weight are bitwise
stock's (the names that differ), and a digest of the weights, which the test compares across the ranks.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).parent)]

CASES = [(1, "fp32", "default"), (2, "fp32", "default"), (2, "bf16", "default"), (1, "fp32", "fused"),
         (2, "fp32", "fused"), (2, "bf16", "fused")]


def main(out: Path) -> None:
    import deepspeed
    from deepspeed import comm as dist
    from zero_train import train

    from pipelines.engine.zero_step import zero_step_on_device_

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=90))  # a mismatch fails, not hangs
    rank = dist.get_rank()
    results = {}
    for stage, precision, kernel in CASES:
        runs = [train(deepspeed, stage, precision, install=install, kernel=kernel, rank=rank, nan_rank=1, nan_in="embedding")
                for install in (None, zero_step_on_device_)]
        (w0, n0, s0, _), (w1, n1, s1, installed) = runs
        digest = hashlib.sha256(b"".join(w1[n].numpy().tobytes() for n in sorted(w1))).hexdigest()
        results[f"zero{stage}-{precision}-{kernel}"] = {
            "installed": installed, "skipped": [s0, s1],
            "norms_finite": [[math.isfinite(float(x)) for x in n] for n in (n0, n1)],
            "same_norms": all(float(a) == float(b) for a, b in zip(n0, n1, strict=True) if math.isfinite(float(a))),
            "differ": [n for n in w0 if not torch.equal(w0[n], w1[n])], "digest": digest}
    out.with_suffix(f".rank-{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
