"""The CPU shim of the megatron engine holds exactly what megatron-core needs on CPU ranks.

With every patch and rewrite of ``roles/engines/training/megatron/cuda_shim.py`` the engine trains
and infers at pp = 2 with a tied embedding and the distributed optimizer, and megatron's RNG
tracker keeps distinct, forkable streams. Taking any one out (in fresh rank processes) breaks that:
a run that still passed would mean megatron-core no longer needs it, and a run that fails with all
of them would mean it needs more. Ranks run at pp = 2 where the missing piece is only reached
through the pipeline (shape exchange, the tied embedding's last-stage copy), else on one rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from roles.engines.training.megatron import cuda_shim
from tests.fixtures.megatron_ranks import shim_rank
from tests.fixtures.ranks import run_ranks
from tests.roles.test_export import tied_model

PIPELINE_ONLY = {"synchronize", "tensor_cuda"}
REMOVABLE = sorted(cuda_shim.PATCHES) + sorted(cuda_shim.REWRITES)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tied_model(tmp_path_factory.mktemp("models") / "tied")


def healthy(results: list[dict[str, Any]]) -> bool:
    return all(r["seeded"] and r["forked"] and r["queued"] == 0 for r in results)


@pytest.mark.timeout(180)
def test_the_engine_runs_with_the_whole_shim(model: Path, tmp_path: Path) -> None:
    results = run_ranks(shim_rank, 2, tmp_path, str(model), "")
    assert healthy(results)
    assert results[0]["grad_norm"] > 0
    assert results[0]["grad_norm"] == pytest.approx(results[1]["grad_norm"], rel=1e-12)


@pytest.mark.extended
@pytest.mark.timeout(180)
@pytest.mark.parametrize("removed", REMOVABLE)
def test_each_part_of_the_shim_is_needed(model: Path, tmp_path: Path, removed: str) -> None:
    world = 2 if removed in PIPELINE_ONLY else 1
    try:
        results = run_ranks(shim_rank, world, tmp_path, str(model), removed)
    except AssertionError as failure:  # a rank failed on a CUDA call: the part is needed
        assert "rank" in str(failure) and "cuda" in str(failure).lower(), failure
        return
    assert not healthy(results), f"megatron-core ran fine without {removed!r}: drop it"
