"""The reward role: rule functions by import path, learned reward models, and their failures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from controller.clients import ActorClient, ReferenceClient, RewardClient, RewardModelClient
from deploy.session import local_session
from roles.modeling.models import init_model, load_tokenizer
from roles.modeling.text import encode_rows
from tests.conftest import TEST_TIMEOUTS, group, run
from transport.batch import TensorBatch
from transport.errors import RemoteError

PROMPTS = ["1+2=", "10+5=", "7+7=", "3+3="]
RESPONSES = ["3", "16", "14", "boom"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


def text(prompts: list[str], responses: list[str], **columns: list[Any]) -> TensorBatch:
    return TensorBatch.from_dict(non_tensors={"prompt": prompts, "response": responses, **columns})


def rule(name: str, path: str, **config: Any) -> Any:
    return group(name, 2, **{name: ("roles.reward:RuleReward", {"function": path, **config})})


def test_rule_rewards_score_rows_split_over_ranks(tiny: Path) -> None:
    async def main() -> None:
        placement = [
            rule("exact", "roles.rules:arithmetic_reward"),
            rule("length", "tests.fixtures.roles:length_reward", tokenizer=str(tiny)),
        ]
        async with local_session(placement, TEST_TIMEOUTS) as c:
            exact = await RewardClient(c, "exact").compute_reward(
                text(PROMPTS, RESPONSES, answer=["3", "15", "14", "6"])
            )
            assert exact["scores"].tolist() == [1.0, 0.0, 1.0, 0.0]
            scored = await RewardClient(c, "length").compute_reward(
                text(PROMPTS, RESPONSES, bonus=[1, 2, 3, 4])
            )
            assert scored["scores"].tolist() == [1.0, 2.0, 2.0, 4.0]
            assert scored["reward/prompt_len"].tolist() == [4.0, 5.0, 4.0, 4.0]
            assert scored["reward/bonus"].tolist() == [1.0, 2.0, 3.0, 4.0]
            assert "reward/note" not in scored.tensors
            # token rows are decoded with the role's tokenizer; metadata rides along
            tokens, _ = encode_rows(load_tokenizer(tiny), PROMPTS, RESPONSES, 64)
            tokens.non_tensors["bonus"] = [0, 0, 0, 0]
            decoded = await RewardClient(c, "length").compute_reward(tokens)
            assert decoded["scores"].tolist() == [1.0, 2.0, 2.0, 4.0]

    run(main)


def test_a_raising_reward_function_names_itself_and_the_row_and_the_role_carries_on() -> None:
    async def main() -> None:
        placement = [
            rule("flaky", "tests.fixtures.roles:failing_reward"),
            rule("wrong", "tests.fixtures.roles:text_reward"),
        ]
        async with local_session(placement, TEST_TIMEOUTS) as c:
            flaky = RewardClient(c, "flaky")
            with pytest.raises(RemoteError) as err:
                await flaky.compute_reward(text(PROMPTS, RESPONSES))
            message = str(err.value)
            assert "tests.fixtures.roles:failing_reward raised ZeroDivisionError" in message
            assert "prompt='3+3='" in message and "response='boom'" in message
            ok = await flaky.compute_reward(text(PROMPTS[:2], RESPONSES[:2]))
            assert ok["scores"].tolist() == [1.0, 1.0]  # same processes, state intact
            with pytest.raises(RemoteError, match=r"returned score '3'.*not a number"):
                await RewardClient(c, "wrong").compute_reward(text(PROMPTS, RESPONSES))

    run(main)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("tests.fixtures.roles", "must look like package.module:function"),
        ("no_such_module:fn", "cannot import 'no_such_module'"),
        ("tests.fixtures.roles:missing", "tests.fixtures.roles has no function 'missing'"),
    ],
)
def test_a_bad_function_path_fails_the_group_with_the_reason(path: str, expected: str) -> None:
    async def main() -> None:
        async with local_session([rule("bad", path)], TEST_TIMEOUTS):
            pass

    with pytest.raises(Exception, match=expected):
        run(main)


def test_reward_model_scores_text_and_tokens_alike_and_the_reference_is_frozen(tiny: Path) -> None:
    config = {"model": str(tiny), "optim": None}

    async def main() -> None:
        placement = [
            group(
                "g",
                2,
                rm=("roles.reward:ModelReward", config),
                ref=("roles.actor:Reference", {"model": str(tiny)}),
                actor=("roles.actor:Actor", {"model": str(tiny)}),
            )
        ]
        async with local_session(placement, TEST_TIMEOUTS) as c:
            rm = RewardModelClient(c, "rm")
            by_text = await rm.compute_reward(text(PROMPTS, RESPONSES))
            tokens, _ = encode_rows(load_tokenizer(tiny), PROMPTS, RESPONSES, 64)
            by_tokens = await rm.compute_reward(tokens)
            assert by_text["scores"].shape == (4,)
            torch.testing.assert_close(by_text["scores"], by_tokens["scores"], atol=1e-6, rtol=0)
            with pytest.raises(RemoteError, match="frozen"):
                await rm.train_pairs(
                    TensorBatch.from_dict(
                        non_tensors={"prompt": PROMPTS, "chosen": RESPONSES, "rejected": RESPONSES}
                    ),
                )
            ref = await ReferenceClient(c, "ref").compute_log_prob(tokens)
            actor = await ActorClient(c, "actor").compute_log_prob(tokens)
            # the same weights: the same log-probs (to float rounding: the two roles' micro-batches
            # differ, and a pass computes logits from its micro-batch's first response token on)
            torch.testing.assert_close(ref["log_probs"], actor["log_probs"], atol=1e-6, rtol=0)
            with pytest.raises(Exception, match="no endpoint 'update_policy'"):
                await ActorClient(c, "ref").update_policy(tokens)  # not a reference endpoint

    run(main)
