"""The training engine's attention setting: which kernel ``auto`` picks, and that eager and the
fused kernel give the same numbers (one rank, in process; no process group is needed at world 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from roles.base import RoleContext
from roles.engines.training.config import EngineConfig
from roles.engines.training.fsdp import FSDPEngine
from roles.modeling.logprob import token_log_probs
from roles.modeling.models import init_model
from roles.runtime.device import EAGER_MAX_WIDTH, HOST_DEVICE, RankDevice, attention_kernel
from tests.roles.test_training import token_batch
from transport.batch import TensorBatch
from transport.device import DeviceKind
from transport.protocol import Layout

CUDA = RankDevice(DeviceKind.CUDA, torch.device("meta"), "nccl")  # a decision, never used


def test_auto_is_eager_only_for_short_bf16_rows_on_cpu() -> None:
    assert attention_kernel("auto", HOST_DEVICE, "bf16", 40) == "eager"
    assert attention_kernel("auto", HOST_DEVICE, "bf16", EAGER_MAX_WIDTH) == "eager"
    assert attention_kernel("auto", HOST_DEVICE, "bf16", EAGER_MAX_WIDTH + 1) == "sdpa"
    assert attention_kernel("auto", HOST_DEVICE, "fp32", 40) == "sdpa"
    assert attention_kernel("auto", CUDA, "bf16", 40) == "sdpa"
    assert attention_kernel("eager", CUDA, "fp32", 4096) == "eager"
    assert attention_kernel("sdpa", HOST_DEVICE, "bf16", 8) == "sdpa"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


def engine(model: Path, dtype: str, attention: str) -> FSDPEngine:
    cfg = EngineConfig(
        model=str(model), dtype=dtype, attention=attention, micro_batch_size=3, optim=None
    )
    ctx = RoleContext("actor", "g", 0, 1, Layout(), None, HOST_DEVICE)
    return FSDPEngine(cfg, ctx)


def log_probs(e: FSDPEngine, batch: TensorBatch) -> tuple[torch.Tensor, str]:
    def read(logits: torch.Tensor, micro: TensorBatch) -> torch.Tensor:
        return token_log_probs(logits, micro.tensor("input_ids"), 1.0)

    found = e.infer(batch, read)
    return found, str(e.model_config._attn_implementation)


@pytest.mark.parametrize("dtype, atol", [("fp32", 1e-5), ("bf16", 0.02)])
def test_eager_and_fused_attention_agree_on_padded_rows(
    tiny: Path, dtype: str, atol: float
) -> None:
    torch.set_num_threads(1)
    batch = token_batch(7, seed=3)  # right-padded rows of 9..20 tokens
    fused, used_fused = log_probs(engine(tiny, dtype, "sdpa"), batch)
    eager, used_eager = log_probs(engine(tiny, dtype, "eager"), batch)
    auto, used_auto = log_probs(engine(tiny, dtype, "auto"), batch)
    assert (used_fused, used_eager) == ("sdpa", "eager")
    assert used_auto == ("eager" if dtype == "bf16" else "sdpa")
    mask = batch.tensor("attention_mask").bool()
    mask[:, 0] = False  # column 0 has no log-prob
    assert fused.shape == eager.shape == mask.shape
    diff = float((fused - eager)[mask].abs().max())
    assert 0 < diff < atol, f"{dtype}: eager and sdpa differ by {diff}"
    assert torch.equal(auto, eager if dtype == "bf16" else fused)
