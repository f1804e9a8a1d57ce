"""A group's prompt computed once: the packing by hand, then the training engine's log-probs and
gradients with the prompts shared against the rows as they are (tiny model, fp32, one rank)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from roles.base import RoleContext
from roles.engines.training.config import EngineConfig, OptimConfig
from roles.engines.training.fsdp import FSDPEngine
from roles.modeling.logprob import read_columns, token_log_probs
from roles.modeling.models import init_model
from roles.modeling.shared_prompt import pack_shared_prompts
from roles.runtime.device import HOST_DEVICE
from transport.batch import TensorBatch
from transport.protocol import Layout

# rows 0 and 1 share the prompt [1, 5, 6]; row 2 (left-padded) has the prompt [1, 7]
IDS = torch.tensor([[1, 5, 6, 10, 11, 12], [1, 5, 6, 20, 21, 0], [0, 1, 7, 30, 31, 32]])
ATTENTION = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]])
RESPONSE = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]])


def test_a_shared_prompt_is_packed_once_and_each_remainder_sees_it_alone() -> None:
    pack = pack_shared_prompts(IDS, ATTENTION, RESPONSE, window=4)
    assert pack is not None
    # unit A: 1 5 6 | 10 11 12 | 20 21 (8 tokens); unit B: 1 7 | 30 31 32 (5) gets a row of its
    # own, since 8 + 5 > 8, the widest unit
    assert pack.input_ids.tolist() == [[1, 5, 6, 10, 11, 12, 20, 21], [1, 7, 30, 31, 32, 0, 0, 0]]
    assert pack.positions.tolist() == [[0, 1, 2, 3, 4, 5, 3, 4], [0, 1, 2, 3, 4, 0, 0, 0]]
    assert (pack.tokens, pack.original) == (13, 16)
    seen = pack.visible[0, 0]
    assert seen[6].tolist() == [True, True, True, False, False, False, True, False]  # 20: prompt
    assert seen[5].tolist() == [True] * 6 + [False, False]  # 12: prompt, 10, 11, itself
    assert pack.visible[1, 0, 7].tolist() == [False] * 7 + [True]  # padding sees only itself
    # logits at each unit's last prompt token and its remainders only
    assert pack.columns.tolist() == [1, 2, 3, 4, 5, 6, 7]


def test_the_gathered_logits_are_those_of_each_rows_own_positions() -> None:
    pack = pack_shared_prompts(IDS, ATTENTION, RESPONSE, window=4)
    assert pack is not None
    # fake logits: channel 0 the packed token at that column, channel 1 its position
    columns = pack.columns
    fake = torch.stack([pack.input_ids[:, columns], pack.positions[:, columns]], dim=-1)
    got = pack.gather(fake.float())  # [3, 4, 2]: the last 4 columns of each row
    for b in range(3):
        real_position = (ATTENTION[b].cumsum(0) - 1).tolist()
        for w, t in enumerate(range(2, 6)):
            prompt_last = int(RESPONSE[b].nonzero()[0]) - 1
            if ATTENTION[b, t] and t >= prompt_last:  # a column whose logits are read
                assert got[b, w].tolist() == [float(IDS[b, t]), float(real_position[t])], (b, t)


def test_distinct_prompts_and_sft_rows_are_left_as_they_are() -> None:
    distinct = IDS.clone()
    distinct[1, 2] = 9
    assert pack_shared_prompts(distinct, ATTENTION, RESPONSE, window=6) is None
    everything = ATTENTION.clone()
    assert pack_shared_prompts(IDS, ATTENTION, everything, window=6) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


def engine(model: Path, share: bool, dtype: str = "fp32") -> FSDPEngine:
    cfg = EngineConfig(
        model=str(model),
        dtype=dtype,
        micro_batch_size=8,
        share_prompts=share,
        optim=OptimConfig(lr=1e-3),
    )
    return FSDPEngine(cfg, RoleContext("actor", "g", 0, 1, Layout(), None, HOST_DEVICE))


def grpo_batch() -> TensorBatch:
    """Two groups of 3 rows (prompts of 9 and 5 tokens) and one row alone; responses of 3..8
    tokens, right-padded."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=gen) for n in (9, 9, 9, 5, 5, 5, 7)]
    prompts[1] = prompts[2] = prompts[0]
    prompts[4] = prompts[5] = prompts[3]
    rows = [
        torch.cat([p, torch.randint(3, 200, (int(3 + (i * 5) % 6),), generator=gen)])
        for i, p in enumerate(prompts)
    ]
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    response = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, rows, strict=True)):
        ids[i, : len(r)] = r
        attention[i, : len(r)] = 1
        response[i, len(p) : len(r)] = 1
    advantages = torch.randn(ids.shape, generator=gen) * response
    return TensorBatch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "response_mask": response,
            "advantages": advantages,
        }
    )


def test_log_probs_and_gradients_equal_the_rows_as_they_are(tiny: Path) -> None:
    torch.set_num_threads(1)
    batch = grpo_batch()
    mask = read_columns(batch.tensor("attention_mask"), batch.tensor("response_mask")).bool()

    def read(logits: torch.Tensor, micro: TensorBatch) -> torch.Tensor:
        return token_log_probs(logits, micro.tensor("input_ids"))

    def loss(
        logits: torch.Tensor, micro: TensorBatch, tokens: float, seqs: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp = token_log_probs(logits, micro.tensor("input_ids"))
        weight = micro.tensor("advantages") * micro.tensor("response_mask")
        return -(logp * weight).sum() / tokens, {}

    grads, found = [], []
    for share in (True, False):
        e = engine(tiny, share)
        found.append(e.infer(batch, read))
        e.forward_backward(batch, loss)
        grads.append(
            {n: p.grad.clone() for n, p in e.module.named_parameters() if p.grad is not None}
        )
    shared, plain = found
    assert float(plain[mask].abs().min()) > 0  # real log-probs were compared
    torch.testing.assert_close(shared[mask], plain[mask], atol=2e-5, rtol=0)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_in_bf16_the_eager_kernel_takes_the_packed_mask(tiny: Path) -> None:
    """bf16 on CPU runs eager attention, which adds the mask to the scores: the packed mask
    must be additive there. The log-probs agree within bf16's rounding of the logits."""
    torch.set_num_threads(1)
    batch = grpo_batch()
    mask = read_columns(batch.tensor("attention_mask"), batch.tensor("response_mask")).bool()

    def read(logits: torch.Tensor, micro: TensorBatch) -> torch.Tensor:
        return token_log_probs(logits, micro.tensor("input_ids"))

    shared_engine = engine(tiny, True, "bf16")
    shared = shared_engine.infer(batch, read)
    assert shared_engine.model_config._attn_implementation == "eager"
    plain = engine(tiny, False, "bf16").infer(batch, read)
    gap = float((shared - plain)[mask].abs().max())
    assert gap < 0.05, gap
