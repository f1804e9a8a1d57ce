"""The CUDA paths at world size 1, on one GPU (marked ``gpu``: skipped without CUDA, counted in
the summary line; ``HYBRIDFLOW_REQUIRE_GPU=1`` fails them instead). Each compares the GPU with the
host on the same model and inputs, within the precision's tolerance:

* the fsdp training engine: log-probs, one optimizer step's loss and weights, results handed
  back in host memory;
* the native generation engine: greedy tokens equal to the host's, and the number of
  device-to-host synchronisations of a call independent of its length (none per decode step);
* a whole GRPO ``--quick`` run of the quickstart with ``device: cuda``, and one with a rollout
  group on the GPU, one step ahead, whose weights arrive by weight sync (reshard) each step.

Multi-rank NCCL cannot run here: NCCL refuses two ranks on one device, so the multi-rank logic
is tested over gloo on the host (tests/roles, tests/reshard) and these tests cover the device.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from roles.base import RoleContext
from roles.engines.generation.interface import SamplingConfig
from roles.engines.generation.native import NativeEngine
from roles.engines.training.config import EngineConfig, OptimConfig
from roles.engines.training.fsdp import FSDPEngine
from roles.modeling.logprob import token_log_probs
from roles.modeling.models import init_model, load_causal_lm, load_tokenizer
from roles.modeling.text import pad_rows
from roles.runtime.device import AUTO_DTYPE_ENV, HOST_DEVICE, RankDevice, rank_device
from tests.deploy.test_run import job, quick_argv, records, summary
from transport.batch import TensorBatch
from transport.device import DeviceKind
from transport.protocol import Layout

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu() -> RankDevice:
    return rank_device(DeviceKind.CUDA, 0, "gpu-tests")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


def engine(model: Path, device: RankDevice, dtype: str) -> FSDPEngine:
    cfg = EngineConfig(
        model=str(model), dtype=dtype, micro_batch_size=4, optim=OptimConfig(lr=1e-3)
    )
    return FSDPEngine(cfg, RoleContext("actor", "g", 0, 1, Layout(), None, device))


def rows(model: Path) -> TensorBatch:
    tokenizer = load_tokenizer(model)
    texts = ["1+2=3", "34+56=90", "7+80=87", "a longer prompt: 12+13=25", "0+0=0", "9+9=18"]
    ids = [tokenizer.encode(t) for t in texts]
    return pad_rows(ids, [[0] * 2 + [1] * (len(i) - 2) for i in ids], tokenizer.pad_token_id)


def read(logits: torch.Tensor, micro: TensorBatch) -> torch.Tensor:
    return token_log_probs(logits, micro.tensor("input_ids"), 1.0)


def sft_loss(
    logits: torch.Tensor, micro: TensorBatch, tokens: float, seqs: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    mask = micro.tensor("response_mask").float()
    log_probs = token_log_probs(logits, micro.tensor("input_ids"), 1.0)
    loss = -(log_probs * mask).sum() / tokens
    return loss, {}


@pytest.mark.parametrize("dtype, atol", [("fp32", 1e-4), ("bf16", 0.08)])
def test_fsdp_engine_on_cuda_matches_the_host(
    gpu: RankDevice, tiny: Path, dtype: str, atol: float
) -> None:
    batch = rows(tiny)
    host, device = engine(tiny, HOST_DEVICE, dtype), engine(tiny, gpu, dtype)
    assert next(device.module.parameters()).device == gpu.device
    on_host, on_gpu = host.infer(batch, read), device.infer(batch, read)
    assert on_gpu.device == on_host.device  # handed back in host memory
    torch.testing.assert_close(on_gpu, on_host, atol=atol, rtol=0)
    a, b = host.train_step(batch, sft_loss), device.train_step(batch, sft_loss)
    assert b["loss"] == pytest.approx(a["loss"], abs=atol * 10)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=0.05)
    for (name, p), q in zip(
        host.module.named_parameters(), device.module.parameters(), strict=True
    ):
        torch.testing.assert_close(q.detach().to(p.device), p.detach(), atol=atol, rtol=0, msg=name)


def _generate_counting_syncs(
    engine: NativeEngine, prompts: list[list[int]], sampling: SamplingConfig
) -> tuple[Any, int]:
    """Samples, and how many synchronising CUDA calls the call made (torch's sync debug mode
    warns at each one)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            samples = engine.generate(prompts, sampling)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return samples, sum("synchroniz" in str(w.message) for w in caught)


def test_native_generation_on_cuda_is_the_hosts_and_syncs_only_where_the_host_looks(
    gpu: RankDevice, tiny: Path
) -> None:
    tokenizer = load_tokenizer(tiny)
    prompts = [tokenizer.encode(t) for t in ["1+2=", "34+56=", "a longer prompt: 12+13="]]
    host_model = load_causal_lm(tiny).eval()
    gpu_model = copy.deepcopy(host_model).to(gpu.device)
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    ours = NativeEngine(gpu_model, tokenizer.eos_token_id).generate(prompts, greedy)
    theirs = NativeEngine(host_model, tokenizer.eos_token_id).generate(prompts, greedy)
    assert [s.tokens for s in ours] == [s.tokens for s in theirs]
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-4, rtol=0
        )
    # no look within the call: the synchronisations are the set-up's and the final read's,
    # as many for 8 steps as for 48
    engine_ = NativeEngine(gpu_model, tokenizer.eos_token_id, check_every=64)
    counts = []
    for steps in (8, 48):
        sampling = SamplingConfig(temperature=1.0, n=4, max_new_tokens=steps, seed=3)
        _, syncs = _generate_counting_syncs(engine_, prompts, sampling)
        counts.append(syncs)
    assert counts[0] == counts[1], counts
    assert NativeEngine(gpu_model, tokenizer.eos_token_id).check_every == 16  # the default


@pytest.mark.timeout(600)
def test_grpo_quick_on_cuda_runs_and_learns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(AUTO_DTYPE_ENV)  # the suite pins auto to fp32; on a GPU auto is bf16
    run_dir = tmp_path / "run"
    overrides = ["placement.main.device=cuda", "placement.main.nproc=1"]
    assert job(quick_argv("quickstart.yaml", run_dir, overrides)) == 0
    result = summary(run_dir)
    assert result["precision"]["actor"]["dtype"] == "bf16"  # auto on a GPU
    rl = [r for r in records(run_dir) if r["stage"] == "grpo" and "stage_step" in r]
    assert rl and all(r["train/response/tokens"] > 0 for r in rl)
    assert result["val_acc_after"] >= result["val_acc_before"] - 0.05


@pytest.mark.timeout(600)
def test_async_grpo_with_a_cuda_rollout_group_synced_from_a_cuda_actor(tmp_path: Path) -> None:
    """Two groups on the one GPU (one rank each): the actor trains, the rollout group generates
    one step ahead, and its weights arrive by weight sync after every step."""
    sets = [
        "roles.rollout={model: base}",
        "placement.gen={roles: [rollout], nproc: 1, device: cuda}",
        "placement.main.nproc=1",
        "placement.main.device=cuda",
        "stages.1.steps=4",
        "stages.1.algorithm.max_staleness=1",
    ]
    run_dir = tmp_path / "run"
    assert job(quick_argv("quickstart.yaml", run_dir, sets)) == 0
    rl = [r for r in records(run_dir) if r["stage"] == "grpo" and "stage_step" in r]
    assert [r["train/staleness"] for r in rl] == [0, 1, 1, 1]
    assert [r["train/weight_version"] for r in rl] == [41, 42, 43, 44]  # 40 SFT steps first
    assert all(r["mem/generate_peak_gib"] > 0 and r["mem/train_peak_gib"] > 0 for r in rl)


def test_a_snapshot_keeps_the_gpus_random_state(gpu: RankDevice, tiny: Path) -> None:
    """Dropout on the GPU draws from the GPU's generator: a snapshot restored must put it back,
    or a replayed ``forward_backward`` draws other masks (the CPU's alone was kept)."""
    from roles.runtime.device import rng_state, set_rng_state

    kept = rng_state(gpu)
    assert set(kept) == {"cpu", "cuda"}
    first = torch.rand(4, device=gpu.device)
    set_rng_state(gpu, kept)
    assert torch.equal(torch.rand(4, device=gpu.device), first)
