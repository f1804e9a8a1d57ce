"""Logits only where they are read: a pass may compute the vocabulary projection only at a row's
last positions (from the one before the earliest response token); the log-probs and entropies
read from them equal a full pass's there and hold 0 before. Hand-computed on a 3-word vocabulary,
then on the tiny model through the training engine's own forward."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from roles.modeling.logprob import logits_kept, token_entropy, token_log_probs
from roles.modeling.models import init_model, load_causal_lm


def test_the_suffix_reads_what_the_full_logits_read_and_zero_before() -> None:
    # 4 positions over a vocabulary of 3; the tokens are 0, 2, 1, 2
    logits = torch.tensor([[[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [5.0, 5.0, 5.0]]])
    ids = torch.tensor([[0, 2, 1, 2]])
    full = token_log_probs(logits, ids)
    # token 1 (id 2) from uniform logits: log 1/3; token 2 (id 1) from [1, 0, 0]:
    # -log(e + 2); token 3 (id 2) from [0, 2, 0]: -log(e^2 + 2)
    expected = [0.0, -math.log(3), -math.log(math.e + 2), -math.log(math.e**2 + 2)]
    assert full[0].tolist() == pytest.approx(expected)
    kept = token_log_probs(logits[:, 1:], ids)  # positions 1..3: read tokens 2 and 3
    assert kept[0].tolist() == pytest.approx([0.0, 0.0, *expected[2:]])
    entropy = token_entropy(logits, width=4)
    assert entropy[0, 1].item() == pytest.approx(math.log(3))
    assert token_entropy(logits[:, 2:], width=4)[0].tolist() == pytest.approx(
        [0.0, 0.0, 0.0, entropy[0, 3].item()]
    )


def test_a_greedy_temperature_reads_temperature_one_and_a_negative_one_is_refused() -> None:
    """Temperature 0 is greedy decoding, whose log-probs every generator reports at 1 (they were
    divided by 0: NaN, and a training step on them made the weights NaN)."""
    logits = torch.tensor([[[0.0, 1.0, 2.0], [2.0, 0.0, 1.0], [0.0, 0.0, 0.0]]])
    ids = torch.tensor([[0, 2, 1]])
    for read in (lambda t: token_log_probs(logits, ids, t), lambda t: token_entropy(logits, t)):
        assert torch.equal(read(0.0), read(1.0))
        with pytest.raises(ValueError, match=r"temperature -0\.5"):
            read(-0.5)


def test_how_many_positions_are_kept() -> None:
    mask = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]])
    assert logits_kept(mask) == 4  # from position 2, before the first response token at 3
    assert logits_kept(torch.tensor([[0, 1, 1]])) == 0  # from position 0: every position
    assert logits_kept(torch.zeros(2, 5, dtype=torch.long)) == 0


def test_the_model_kept_logits_give_the_full_passes_log_probs(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model = load_causal_lm(init_model(tmp_path / "tiny", "tiny", seed=0)).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (3, 12), generator=gen)
    response = (torch.arange(12)[None, :] >= torch.tensor([[5], [7], [9]])).long()
    keep = logits_kept(response)
    assert keep == 8
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        part = model(input_ids=ids, logits_to_keep=keep).logits
    assert part.shape[1] == keep
    mask = response.bool()
    torch.testing.assert_close(
        token_log_probs(part, ids)[mask], token_log_probs(whole, ids)[mask], atol=1e-6, rtol=0
    )
