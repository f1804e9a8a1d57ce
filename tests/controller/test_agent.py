"""Multi-turn rollouts (``controller/agent.py``) through real role groups: an actor generating on
the tiny model and an env group hosting a test environment (``tests/fixtures/envs.py``).

One session serves every test: trajectories token in / token out (the training row is the sampled
and observation ids, the loss mask exactly the sampled tokens, and the trainer's log-probs of the
row equal the sampled ones), continuous serving against lock step (the same trajectories; a slow
environment step holds back only its own trajectory), and a failing environment step becoming an
observation.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from controller.agent import AgentConfig, AgentRollout, run_trajectories
from controller.clients import ActorClient, EnvClient
from deploy.session import local_session
from roles.modeling.models import init_model, load_tokenizer
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.envs import Counter
from transport.batch import TensorBatch
from transport.sampling import SamplingConfig

PROMPTS = ["1+2=", "slow", "34+56=", "a longer prompt"]
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=6, n=2, seed=5)


def prompts(texts: list[str]) -> TensorBatch:
    batch = TensorBatch.from_dict(non_tensors={"prompt": texts, "uid": list(range(len(texts)))})
    batch.non_tensors["seed"] = [11 * i + 1 for i in range(len(texts))]
    return batch


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)
    actor = {"model": str(model), "micro_batch_size": 8, "optim": {"lr": 1e-2}}
    counter = {"environment": "tests.fixtures.envs:Counter", "tokenizer": str(model)}
    broken = {"environment": "tests.fixtures.envs:Broken", "tokenizer": str(model)}
    placement = [
        group("a", 1, actor=("roles.actor:Actor", actor)),
        group("e", 1, env=("roles.env:EnvRole", counter)),
        group("b", 1, broken=("roles.env:EnvRole", broken)),
    ]

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {"model": model}
        async with local_session(placement, TEST_TIMEOUTS) as c:
            actor = ActorClient(c, "actor")
            for name, role in (("env", "env"), ("broken", "broken")):
                env = EnvClient(c, role)
                spec = await env.spec()
                for serving in ("continuous", "lockstep"):
                    cfg = AgentConfig(max_turns=4, max_total_tokens=96, serving=serving)
                    setup = AgentRollout(actor, env, cfg, spec, first_session=1000 * len(out))
                    texts = PROMPTS if name == "env" else PROMPTS[:2]
                    batch = await run_trajectories(setup, prompts(texts), SAMPLING, 0)
                    out[f"{name}_{serving}"] = batch
            env = EnvClient(c, "env")  # lock step again, every turn prefilled in full
            cfg = AgentConfig(max_turns=4, max_total_tokens=96, serving="lockstep", sessions=False)
            setup = AgentRollout(actor, env, cfg, await env.spec(), first_session=9000)
            out["env_lockstep_plain"] = await run_trajectories(setup, prompts(PROMPTS), SAMPLING, 0)
            out["held_after"] = await actor.drop_sessions([f"t{1000 + i}" for i in range(8)])
            batch = out["env_continuous"]
            out["recomputed"] = (await actor.compute_log_prob(batch))["log_probs"]
        return out

    return run(main)


def test_rows_are_sampled_and_observation_tokens_and_the_mask_is_the_sampled_ones(
    results: dict[str, Any],
) -> None:
    batch = results["env_continuous"]
    tokenizer = load_tokenizer(results["model"])
    ids, mask = batch.tensors["input_ids"], batch.tensors["response_mask"].bool()
    attention = batch.tensors["attention_mask"].bool()
    assert len(batch) == len(PROMPTS) * SAMPLING.n
    for row in range(len(batch)):
        text = batch.non_tensors["prompt"][row]
        prompt = [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]
        real = ids[row][attention[row]].tolist()
        assert real[: len(prompt)] == prompt  # the start: the prompt as the generator reads it
        assert not mask[row][: len(prompt)].any()
        after = real[len(prompt) :]
        shown = mask[row][attention[row]][len(prompt) :].tolist()
        # what follows the prompt, decoded piece by piece (sampled runs, observation runs), is the
        # transcript: every observation's text sits between the turns, untouched
        pieces, current, kind = [], [after[0]], shown[0]
        for token, m in zip(after[1:], shown[1:], strict=True):
            if m != kind:
                pieces.append((kind, current))
                current, kind = [], m
            current.append(token)
        pieces.append((kind, current))
        observations = [tokenizer.decode(p) for k, p in pieces if not k]
        assert all(o.startswith("<") and o.endswith(">") for o in observations), observations
        whole = tokenizer.decode(after, skip_special_tokens=True)
        assert whole == batch.non_tensors["transcript"][row]
        turns = int(batch.non_tensors["turns"][row])
        assert len(observations) == turns  # a Counter step follows every turn
        assert sum(k for k, _ in pieces) == turns  # one sampled run per turn


def test_each_row_carries_its_budget_of_sampled_tokens(results: dict[str, Any]) -> None:
    """max_total_tokens (96) less the prompt and observation tokens: what DAPO's overlong
    shaping measures a trajectory's sampled tokens against."""
    batch = results["env_continuous"]
    given = batch.tensors["attention_mask"].sum(-1) - batch.tensors["response_mask"].sum(-1)
    assert batch.tensors["sample_budget"].tolist() == (96 - given).tolist()
    assert (batch.tensors["response_mask"].sum(-1) <= batch.tensors["sample_budget"]).all()


def test_the_trainers_log_probs_equal_the_sampled_ones_on_the_masked_tokens(
    results: dict[str, Any],
) -> None:
    batch = results["env_continuous"]
    mask = batch.tensors["response_mask"].bool()
    sampled = batch.tensors["log_probs"][mask]
    recomputed = results["recomputed"][mask]
    assert sampled.numel() > 20
    torch.testing.assert_close(recomputed, sampled, atol=1e-5, rtol=0)


def test_three_steps_then_done_and_the_env_reward_and_versions_come_through(
    results: dict[str, Any],
) -> None:
    batch = results["env_continuous"]
    assert batch.non_tensors["turns"] == [3] * len(batch)  # a turn cut at its limit counts
    assert batch.non_tensors["finish"] == ["done"] * len(batch)
    versions = batch.tensors["token_versions"]
    mask = batch.tensors["response_mask"].bool()
    assert (versions[mask] == 0).all() and (versions[~mask] == -1).all()
    rewards = torch.tensor([float(r) for r in batch.non_tensors["env_reward"]])
    assert ((rewards >= 0) & (rewards <= 3)).all() and rewards.sum() > 0


def test_lockstep_serving_gives_the_same_trajectories(results: dict[str, Any]) -> None:
    """The same tokens; the log-probs to rounding (the calls batch other rows together)."""
    a, b = results["env_continuous"], results["env_lockstep"]
    for name in ("input_ids", "response_mask"):
        assert torch.equal(a.tensors[name], b.tensors[name])
    torch.testing.assert_close(a.tensors["log_probs"], b.tensors["log_probs"], atol=1e-5, rtol=0)
    assert a.non_tensors["transcript"] == b.non_tensors["transcript"]


def test_sessions_prefill_only_what_is_new_and_sample_as_a_full_prefill(
    results: dict[str, Any],
) -> None:
    """The actor keeps each trajectory's KV between its turns: later turns prefill only the
    observation (and the last sampled token), the tokens are those of full re-prefills and the
    log-probs agree to rounding; the rollout lets go of its sessions when it ends."""
    kept, plain = results["env_lockstep"], results["env_lockstep_plain"]
    for name in ("input_ids", "response_mask"):
        assert torch.equal(kept.tensors[name], plain.tensors[name])
    torch.testing.assert_close(
        kept.tensors["log_probs"], plain.tensors["log_probs"], atol=1e-5, rtol=0
    )
    reuse = kept.meta["agent"]["agent/prefix_reuse"]
    assert reuse > 0.5, reuse
    assert plain.meta["agent"]["agent/prefix_reuse"] == 0.0
    assert results["held_after"] == 0  # dropped at the end of their batch


def test_a_slow_step_holds_back_only_its_own_trajectory_when_serving_continuously(
    results: dict[str, Any],
) -> None:
    slow_s = Counter.slow_s
    for serving in ("continuous", "lockstep"):
        batch = results[f"env_{serving}"]
        seconds = [float(s) for s in batch.non_tensors["seconds"]]
        slow = [p == "slow" for p in batch.non_tensors["prompt"]]
        slow_rows = [s for s, is_slow in zip(seconds, slow, strict=True) if is_slow]
        fast_rows = [s for s, is_slow in zip(seconds, slow, strict=True) if not is_slow]
        assert min(slow_rows) >= slow_s
        if serving == "continuous":  # the others finished all their turns meanwhile
            assert max(fast_rows) < slow_s, seconds
        else:  # every turn waited for the slowest action of the batch
            assert min(fast_rows) >= slow_s, seconds
    metrics = results["env_continuous"].meta["agent"]
    assert metrics["agent/tool_latency_p99_s"] >= slow_s
    assert 0.0 <= metrics["agent/generator_idle_share"] <= 1.0


def test_an_environment_that_raises_becomes_an_observation_and_is_counted(
    results: dict[str, Any],
) -> None:
    batch = results["broken_continuous"]
    metrics = batch.meta["agent"]
    second_steps = sum(int(t) >= 2 for t in batch.non_tensors["turns"])
    assert second_steps >= 1
    assert metrics["agent/tool_errors/env"] == float(second_steps)
    raised = [t for t in batch.non_tensors["transcript"] if "the board caught fire" in t]
    assert len(raised) == second_steps
    assert all(t.startswith("start:") is False for t in batch.non_tensors["transcript"])
