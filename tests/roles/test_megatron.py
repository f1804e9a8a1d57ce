"""The megatron engine through real role groups equals the fsdp engine on one rank (fp32, 1e-5).

Every engine method of ``tests/roles/test_training.py``'s ``exercise`` (log-probs with entropy,
values, PPO step, value step, uneven batches, checkpoint save -> load -> replay, export, bad calls,
SFT step and eval, reward-model pairs) runs on megatron groups, each hosting an actor, a critic
and a reward model colocated (one megatron parallel state), beside the fsdp engine on one rank:

* ``mtp`` tp 2; ``mpp`` pp 2 (1F1B schedule); ``mtppp`` tp 2 x pp 2 (4 ranks);
* ``dp_mvpp`` dp 2 x pp 2 with vpp 2 (the interleaved schedule) and the distributed optimizer.

Then the weights: exported after the PPO steps and again after the SFT step, each within 1e-5 of
the fsdp engine's; and left-padded rows (which megatron's RoPE cannot see as such: the engine moves
them) score like the fsdp engine's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from controller.clients import ActorClient, CriticClient
from controller.placement import GroupSpec
from deploy.session import local_session
from roles.modeling.models import init_model
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.megatron_ranks import two_layouts_rank
from tests.fixtures.ranks import run_ranks
from tests.roles.test_training import exercise, token_batch, without_peak
from transport.batch import TensorBatch
from transport.protocol import PEAK_MEMORY

# name: (nproc, tp, pp, extra engine settings)
SESSIONS: dict[str, dict[str, tuple[int, int, int, dict[str, Any]]]] = {
    "a": {"mtp": (2, 2, 1, {}), "mpp": (2, 1, 2, {})},
    "b": {
        "mtppp": (4, 2, 2, {}),
        "dp_mvpp": (4, 1, 2, {"vpp": 2, "distributed_optimizer": True}),
    },
}
# eight rank processes start at once on a small CPU: registering takes longer than elsewhere
TIMEOUTS = TEST_TIMEOUTS.model_copy(update={"connect_s": 300, "call_s": 300, "group_init_s": 60})
TENSORS = ("log_probs", "entropy", "values", "after", "values_after", "after_again")
METRICS = ("policy", "critic", "uneven", "policy_again", "sft", "sft_eval", "rm_train")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


def roles(name: str, config: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        f"actor_{name}": ("tests.fixtures.actor:ProbedActor", config),
        f"critic_{name}": ("roles.critic:Critic", config),
        f"rm_{name}": ("roles.reward:ModelReward", config),
    }


def placement(model: Path, session: str) -> list[GroupSpec]:
    base = {"model": str(model), "dtype": "fp32", "micro_batch_size": 2, "optim": {"lr": 1e-4}}
    groups = [
        group(name, nproc, tp=tp, pp=pp, **roles(name, {**base, "backend": "megatron", **extra}))
        for name, (nproc, tp, pp, extra) in SESSIONS[session].items()
    ]
    if session == "a":
        groups.append(group("one", 1, **roles("one", base)))
    return groups


def left_padded(batch: TensorBatch) -> TensorBatch:
    """The same rows with their padding moved to the front."""
    mask = batch["attention_mask"]
    width = mask.shape[1]
    index = (torch.arange(width)[None, :] - (width - mask.sum(-1))[:, None]) % width
    return TensorBatch.from_dict({k: v.gather(1, index) for k, v in batch.tensors.items()})


async def exercise_more(c: Any, name: str, batch: TensorBatch, ckpt: Path) -> dict[str, Any]:
    out = await exercise(c, name, batch, ckpt)
    actor = ActorClient(c, f"actor_{name}")
    await actor.export(str(ckpt / "export_sft"))  # after the SFT step of ``exercise``
    out["left"] = (await actor.compute_log_prob(left_padded(batch)))["log_probs"]
    out["right"] = (await actor.compute_log_prob(batch))["log_probs"]
    return out


def scenario(model: Path, session: str, tmp: Path) -> dict[str, dict[str, Any]]:
    batch = token_batch(6, seed=1)

    async def main() -> dict[str, dict[str, Any]]:
        async with local_session(placement(model, session), TIMEOUTS) as c:
            names = [g.name for g in placement(model, session)]
            found = await asyncio.gather(*(exercise_more(c, n, batch, tmp / n) for n in names))
            return dict(zip(names, found, strict=True))

    result: dict[str, dict[str, Any]] = run(main)
    return result


@pytest.fixture(scope="module")
def results(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for session in SESSIONS:
        found.update(scenario(tiny, session, tmp_path_factory.mktemp(f"megatron_{session}")))
    return found


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m: f"{what}: {m}")


def exported(results: dict[str, Any], tmp: Path, name: str, folder: str) -> dict[str, torch.Tensor]:
    path = next(tmp.glob(f"megatron_*/{name}/{folder}/model.safetensors"))
    return load_file(str(path))


MEGATRON = [name for groups in SESSIONS.values() for name in groups]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", MEGATRON)
def test_engine_methods_match_fsdp_on_one_rank(results: dict[str, Any], name: str) -> None:
    one, other = results["one"], results[name]
    for key in (*TENSORS, "rm_chosen", "rm_rejected"):
        close(other[key], one[key], key)
    for metrics in METRICS:
        assert set(other[metrics]) == set(one[metrics]), metrics
        for key, value in one[metrics].items():
            if key == PEAK_MEMORY:  # what the process held, not a result of the step
                assert other[metrics][key] > 0
                continue
            assert other[metrics][key] == pytest.approx(value, abs=1e-5), (metrics, key)


@pytest.mark.parametrize("name", MEGATRON)
def test_checkpoint_replays_the_step_bitwise(results: dict[str, Any], name: str) -> None:
    result = results[name]
    assert (result["after"] - result["log_probs"]).abs().max() > 1e-3  # it learned
    assert torch.equal(result["after_again"], result["after"])
    assert torch.equal(result["after_errors"], result["after"])  # bad calls changed nothing
    assert without_peak(result["policy_again"]) == without_peak(result["policy"])
    assert result["draw_again"] == result["draw"]


@pytest.mark.parametrize("name", MEGATRON)
@pytest.mark.parametrize("folder", ["export", "export_sft"])
def test_weights_after_ppo_and_sft_match_fsdp(
    results: dict[str, Any], tmp_path_factory: pytest.TempPathFactory, name: str, folder: str
) -> None:
    base = tmp_path_factory.getbasetemp()
    ours = exported(results, base, name, folder)
    theirs = load_file(str(next(base.glob(f"megatron_a*/one/{folder}/model.safetensors"))))
    assert set(ours) == set(theirs)
    for key, tensor in theirs.items():
        close(ours[key], tensor, key)


@pytest.mark.parametrize("name", MEGATRON)
def test_left_padded_rows_score_like_fsdp(results: dict[str, Any], name: str) -> None:
    mask = left_padded(token_batch(6, seed=1))["attention_mask"]
    # a row's first real token has no real token before it: its number is padding's, unread
    seen = mask * torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)
    close(results[name]["left"] * seen, results["one"]["left"] * seen, "left-padded log-probs")
    right = token_batch(6, seed=1)
    moved = left_padded(TensorBatch.from_dict({"lp": results[name]["right"], **right.tensors}))
    close(results[name]["left"] * seen, moved["lp"] * seen, "left vs right padding")


def test_param_layout_is_in_hf_names_with_stages(results: dict[str, Any]) -> None:
    layout = results["mtppp"]["layout"]
    assert set(layout) == set(results["one"]["layout"])
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.o_proj.weight"
    assert layout[q] == {"shape": [128, 128], "tp_dim": 0, "dp_dim": None, "pp_stage": 0}
    assert layout[o] == {"shape": [128, 128], "tp_dim": 1, "dp_dim": None, "pp_stage": 1}
    assert layout["lm_head.weight"]["pp_stage"] == 1
    assert layout["model.embed_tokens.weight"]["pp_stage"] == 0
    # vpp 2 at pp 2: layers 0 and 2 on stage 0, 1 and 3 on stage 1
    stages = [
        results["dp_mvpp"]["layout"][f"model.layers.{i}.mlp.up_proj.weight"]["pp_stage"]
        for i in range(4)
    ]
    assert stages == [0, 1, 0, 1]


@pytest.mark.timeout(600)
def test_bf16_autocast_matches_fsdp_within_1e_2(tiny: Path) -> None:
    """bf16 autocast (fp32 master weights) at tp 2 x pp 2 against the fsdp engine on one rank:
    stages hand each other fp32 activations, the backward runs under autocast too."""
    base = {"model": str(tiny), "dtype": "bf16", "micro_batch_size": 2, "optim": {"lr": 1e-4}}
    groups = [
        group("one", 1, **roles("one", base)),
        group("mtppp", 4, tp=2, pp=2, **roles("mtppp", {**base, "backend": "megatron"})),
    ]
    batch = token_batch(6, seed=1)

    async def scores(c: Any, name: str) -> dict[str, Any]:
        actor, critic = ActorClient(c, f"actor_{name}"), CriticClient(c, f"critic_{name}")
        first = await actor.compute_log_prob(batch)
        step = batch.union(TensorBatch.from_dict({"old_log_probs": first["log_probs"]}))
        policy = await actor.update_policy(step)
        after = (await actor.compute_log_prob(batch))["log_probs"]
        values = (await critic.compute_values(batch))["values"]
        return {"first": first["log_probs"], "after": after, "values": values, **policy}

    async def main() -> list[dict[str, Any]]:
        async with local_session(groups, TIMEOUTS) as c:
            return list(await asyncio.gather(scores(c, "one"), scores(c, "mtppp")))

    one, other = run(main)
    for key in ("first", "after", "values"):
        torch.testing.assert_close(other[key], one[key], atol=1e-2, rtol=0)
    assert other["loss"] == pytest.approx(one["loss"], abs=1e-2)


@pytest.mark.timeout(180)
def test_colocated_roles_of_another_layout_are_refused(tiny: Path, tmp_path: Path) -> None:
    """megatron-core's parallel state is one per process: a second engine of the same layout
    shares it, one of another layout gets an error naming both layouts and the way out."""
    for message in run_ranks(two_layouts_rank, 2, tmp_path, str(tiny)):
        assert "already set to tp=2 pp=1 vpp=1" in message
        assert "asks for tp=1 pp=2 vpp=1" in message and "its own group" in message
