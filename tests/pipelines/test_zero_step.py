"""DeepSpeed ZeRO-1/2's step without host waits (``pipelines.engine.zero_step``) on 2 ranks computes what stock
DeepSpeed computes: the same weights bitwise, the same norms, and the step one rank's NaN gradient spoils
skipped on every rank -- with the norm read once before the update (torch's default AdamW) or not at all
(the fused AdamW, the GPU recipes' kernel). One rank: tests/pipelines/test_one_rank.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from job_helpers import two_rank_results
from zero_train import NAN_STEP, STEPS

JOB = Path(__file__).with_name("zero_step_job.py")
SKIPPED = [i == NAN_STEP for i in range(STEPS)]


def _installed(precision: str, kernel: str) -> list[str]:
    update = "update_skipped_on_the_device" if kernel == "fused" else "norm_read_before_the_update"
    overflow = ["overflow_from_the_norm"] if precision == "bf16" else []  # bf16 checks before the norm; fp32 does not
    return ["foreach_grad_norm", *overflow, "clip_without_host_reads", update, "bit16_views_kept"]


@pytest.mark.slow
def test_two_ranks_step_without_host_waits_as_stock_deepspeed_bitwise(tmp_path):
    ranks = two_rank_results(JOB, tmp_path / "zero_step.json")
    assert ranks[0].keys() == ranks[1].keys() and len(ranks[0]) == 6
    for case, result in ranks[0].items():
        stage, precision, kernel = case.split("-")
        for rank in ranks:
            r = rank[case]
            assert r["installed"] == _installed(precision, kernel), case
            assert r["skipped"] == [SKIPPED, SKIPPED], case  # rank 1's NaN skips the step on rank 0 too, as stock
            assert r["norms_finite"] == [[not s for s in SKIPPED]] * 2 and r["same_norms"], case
            assert r["differ"] == [], f"{case}: weights differ from stock DeepSpeed's: {r['differ']}"
        assert ranks[1][case]["digest"] == result["digest"], f"{case}: the ranks' weights differ"
