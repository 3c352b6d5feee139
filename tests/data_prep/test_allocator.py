"""The prep workers' allocator (`data_prep.allocator`): which library `auto` picks, that the Ray tasks
really run with it, and that a wrong path is refused before anything is written."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from data_prep.allocator import find_worker_malloc, worker_runtime_env
from data_prep.config import PrepConfig, SourceConfig
from data_prep.errors import PrepError
from data_prep.job import _task, run_prepare

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is a Linux loader feature")


def test_system_means_no_preload_and_a_missing_path_names_the_fix(tmp_path):
    assert find_worker_malloc("system") is None and worker_runtime_env("system") is None
    with pytest.raises(PrepError, match=r"worker_malloc=.*no such file.*auto"):
        find_worker_malloc(str(tmp_path / "libnothing.so"))


@linux_only
def test_auto_finds_a_faster_malloc_ray_bundles_one_at_least():
    import ray

    picked = find_worker_malloc("auto")
    assert picked, "Ray's wheel ships core/libjemalloc.so, so auto always finds one on Linux"
    env = worker_runtime_env("auto")["env_vars"]
    assert env["LD_PRELOAD"].split()[0] == picked
    jemalloc = Path(ray.__file__).parent / "core" / "libjemalloc.so"
    assert find_worker_malloc(str(jemalloc)) == str(jemalloc.resolve())


@linux_only
def test_prep_tasks_run_with_the_chosen_malloc(ray_cluster):
    import ray

    def loaded_mallocs() -> list[str]:  # defined here so Ray ships it by value (tests are not importable there)
        maps = Path("/proc/self/maps").read_text().splitlines()
        return sorted({line.split()[-1] for line in maps if "malloc" in line.rsplit("/", 1)[-1]})

    jemalloc = str((Path(ray.__file__).parent / "core" / "libjemalloc.so").resolve())
    cfg = PrepConfig(output="unused", sources=[SourceConfig(paths=["unused"])], worker_malloc=jemalloc)
    assert jemalloc in ray.get(_task(loaded_mallocs, cfg).remote())
    cfg.worker_malloc = "system"
    assert not ray.get(_task(loaded_mallocs, cfg).remote())


def test_a_wrong_malloc_path_fails_before_the_output_is_created(tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text("A paragraph long enough to keep.\n\nAnother paragraph long enough to keep.\n")
    out = tmp_path / "corpus"
    cfg = PrepConfig(output=str(out), sources=[SourceConfig(paths=[str(corpus)])], worker_malloc=str(tmp_path / "missing.so"))
    with pytest.raises(PrepError, match="missing.so"):
        run_prepare(cfg)
    assert not out.exists()
