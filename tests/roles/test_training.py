"""The fsdp training engine through real role groups: dp = 2 and tp = 2 (gloo) match 1 rank.

One session runs three groups side by side — 1 rank, dp = 2, tp = 2 — each hosting an actor and a
critic (colocated), and every engine method is called on all three with the same global batch.
The batch has 6 rows and micro-batches of 2, so dp = 2 runs uneven micro-batches (2 + 1 rows);
a 5-row batch makes the dp ranks run different numbers of micro-batches, and the text endpoints
on one row give a dp rank none.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from controller.clients import CriticClient, RewardModelClient
from controller.tasks import preference
from deploy.session import local_session
from roles.modeling.logprob import read_columns, token_log_probs
from roles.modeling.models import init_model
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.fixtures.clients import ProbedActorClient
from transport.batch import TensorBatch
from transport.errors import RemoteError
from transport.protocol import PEAK_MEMORY

ROWS = [{**row, "response": row["chosen"]} for row in preference(7, "train", seed=0)]
# name: (dp, tp, dp_mode)
LAYOUTS = {
    "one": (1, 1, "fsdp"),
    "dp": (2, 1, "fsdp"),
    "tp": (1, 2, "fsdp"),
    "dp_tp": (2, 2, "fsdp"),
    "dp_replicate": (2, 1, "replicate"),
}
POLICY_LOSS = {"clip_ratio_low": 0.2, "dual_clip": 3.0, "entropy_coef": 0.01, "kl_coef": 0.1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


def token_batch(rows: int, seed: int, vocab: int = 250) -> TensorBatch:
    """Right-padded rows of 9..20 tokens; the second half of each row is the response."""
    gen = torch.Generator().manual_seed(seed)
    width = 20
    lengths = torch.randint(9, width + 1, (rows,), generator=gen)
    ids = torch.randint(3, vocab, (rows, width), generator=gen)
    attention = (torch.arange(width)[None, :] < lengths[:, None]).long()
    response = attention * (torch.arange(width)[None, :] >= (lengths // 2)[:, None]).long()
    ids = ids * attention
    return TensorBatch.from_dict(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "response_mask": response,
            "advantages": torch.randn(rows, width, generator=gen) * response,
            "returns": torch.randn(rows, width, generator=gen) * response,
        }
    )


def placement(model: Path, dtype: str, layouts: dict[str, Any] = LAYOUTS) -> list[Any]:
    def config(mode: str) -> dict[str, Any]:
        return {
            "model": str(model),
            "dtype": dtype,
            "dp_mode": mode,
            "micro_batch_size": 2,
            "optim": {"lr": 1e-4},
        }

    return [
        group(
            name,
            dp * tp,
            tp=tp,
            **{
                f"actor_{name}": ("tests.fixtures.actor:ProbedActor", config(mode)),
                f"critic_{name}": ("roles.critic:Critic", config(mode)),
                f"rm_{name}": ("roles.reward:ModelReward", config(mode)),
            },
        )
        for name, (dp, tp, mode) in layouts.items()
    ]


async def exercise(c: Any, name: str, batch: TensorBatch, ckpt: Path) -> dict[str, Any]:
    """Every engine method once, in order; returns what each produced."""
    actor, critic = ProbedActorClient(c, f"actor_{name}"), CriticClient(c, f"critic_{name}")
    out: dict[str, Any] = {}
    first = await actor.compute_log_prob(batch, entropy=True)
    out["log_probs"], out["entropy"] = first["log_probs"], first["entropy"]
    batch = batch.union(
        TensorBatch.from_dict(
            {"old_log_probs": first["log_probs"], "ref_log_probs": first["log_probs"] - 0.05}
        )
    )
    out["values"] = (await critic.compute_values(batch))["values"]
    await actor.save(str(ckpt / "actor"))
    out["draw"] = await actor.draw()
    out["policy"] = await actor.update_policy(batch, loss=POLICY_LOSS)
    out["after"] = (await actor.compute_log_prob(batch))["log_probs"]
    out["critic"] = await critic.update_critic(
        batch.union(TensorBatch.from_dict({"values": out["values"]})),
        loss={"clip": 0.5},
    )
    out["values_after"] = (await critic.compute_values(batch))["values"]
    uneven = batch[:5]  # dp ranks get 3 and 2 rows: 2 vs 1 micro-batches
    out["uneven"] = await actor.update_policy(uneven, loss=POLICY_LOSS)
    # back to the checkpoint: the same step again must give the same weights, bit for bit
    assert await actor.load(str(ckpt / "actor")) == 0
    out["draw_again"] = await actor.draw()  # the random stream is restored too
    out["policy_again"] = await actor.update_policy(batch, loss=POLICY_LOSS)
    out["after_again"] = (await actor.compute_log_prob(batch))["log_probs"]
    out["layout"] = await actor.param_layout()
    await actor.export(str(ckpt / "export"))
    # bad calls fail on every rank alike, before any collective, and leave the engine usable
    with pytest.raises(RemoteError, match=r"lacks tensor column\(s\) \['advantages'\]"):
        await actor.update_policy(
            batch.select(["input_ids", "attention_mask", "response_mask", "old_log_probs"]),
            loss={},
        )
    if name.startswith("dp"):  # fewer rows than dp ranks: the client gives the idle rank a copy
        out["one_row"] = (await actor.compute_log_prob(batch[:1]))["log_probs"]
    out["after_errors"] = (await actor.compute_log_prob(batch))["log_probs"]
    # text endpoints: SFT on (prompt, response), reward-model pairs (7 rows: uneven over dp)
    rows = TensorBatch.from_dict(non_tensors={k: [r[k] for r in ROWS] for k in ROWS[0]})
    out["sft"] = await actor.sft_step(rows)
    out["sft_eval"] = await actor.sft_eval(rows)
    rm = RewardModelClient(c, f"rm_{name}")
    out["rm_train"] = await rm.train_pairs(rows)
    scored = await rm.score_pairs(rows)
    out["rm_chosen"], out["rm_rejected"] = scored["chosen"], scored["rejected"]
    return out


async def one_text_row(c: Any, name: str) -> dict[str, Any]:
    """The text endpoints on one row (one pair): fewer rows than dp ranks, so the client gives
    the idle rank a copy that counts in no loss and no count (without one that rank raised and
    the other waited in a collective until the group's timeout, every later call failing)."""
    rows = TensorBatch.from_dict(non_tensors={k: [ROWS[0][k]] for k in ROWS[0]})
    actor, rm = ProbedActorClient(c, f"actor_{name}"), RewardModelClient(c, f"rm_{name}")
    return {
        "sft_one": await actor.sft_step(rows),
        "sft_eval_one": await actor.sft_eval(rows),
        "rm_one": await rm.train_pairs(rows),
    }


def scenario(
    model: Path, dtype: str, tmp: Path, layouts: dict[str, Any] = LAYOUTS
) -> dict[str, dict[str, Any]]:
    batch = token_batch(6, seed=1)

    async def main() -> dict[str, dict[str, Any]]:
        async def both(c: Any, name: str) -> dict[str, Any]:
            return {**await exercise(c, name, batch, tmp / name), **await one_text_row(c, name)}

        async with local_session(placement(model, dtype, layouts), TEST_TIMEOUTS) as c:
            names = list(layouts)
            results = await asyncio.gather(*(both(c, n) for n in names))
            return dict(zip(names, results, strict=True))

    found: dict[str, dict[str, Any]] = run(main)
    return found


@pytest.fixture(scope="module")
def fp32(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return scenario(tiny, "fp32", tmp_path_factory.mktemp("fp32"))


def without_peak(metrics: dict[str, float]) -> dict[str, float]:
    """A step's metrics less the rank's peak memory (what the process held, not a result)."""
    return {k: v for k, v in metrics.items() if k != PEAK_MEMORY}


def close(a: torch.Tensor, b: torch.Tensor, atol: float, what: str = "") -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["dp", "tp", "dp_tp", "dp_replicate"])
def test_fp32_engine_methods_match_one_rank(fp32: dict[str, dict[str, Any]], name: str) -> None:
    one, other = fp32["one"], fp32[name]
    tensors = ("log_probs", "entropy", "values", "after", "values_after", "after_again")
    for key in (*tensors, "rm_chosen", "rm_rejected"):
        close(other[key], one[key], 1e-5, key)
    steps = ("policy", "critic", "uneven", "policy_again", "sft", "sft_eval", "rm_train")
    for metrics in (*steps, "sft_one", "sft_eval_one", "rm_one"):
        for key, value in without_peak(one[metrics]).items():
            assert other[metrics][key] == pytest.approx(value, abs=1e-5), (metrics, key)
    if "one_row" in other:  # one row on 2 dp ranks: its log-probs as in the whole batch
        mask = token_batch(6, seed=1)["response_mask"][:1].bool()
        close(other["one_row"][mask], other["after_errors"][:1][mask], 1e-5, "one_row")


def test_update_changes_the_policy_and_checkpoint_replays_it_exactly(
    fp32: dict[str, dict[str, Any]],
) -> None:
    for result in fp32.values():
        assert (result["after"] - result["log_probs"]).abs().max() > 1e-3  # it learned
        assert torch.equal(result["after_again"], result["after"])  # load -> identical step
        assert torch.equal(result["after_errors"], result["after"])  # bad calls changed nothing
        assert without_peak(result["policy_again"]) == without_peak(result["policy"])
        assert result["policy"][PEAK_MEMORY] > 0
        assert result["draw_again"] == result["draw"]
        assert result["policy"]["grad_norm"] > 0 and result["policy"]["kl"] > 0


def test_log_probs_are_zero_outside_what_is_read(fp32: dict[str, dict[str, Any]]) -> None:
    """Padding holds 0, and so does each row's prompt (a pass computes logits only from the
    earliest response token of its micro-batch on; what a row reads does not depend on its
    micro-batch's other rows); every other real token has a log-prob."""
    batch = token_batch(6, seed=1)
    read = read_columns(batch["attention_mask"], batch["response_mask"]).bool()
    logp = fp32["one"]["log_probs"]
    assert bool((logp[~read] == 0).all()) and bool((logp[read] < 0).all())


def test_param_layout_names_the_sharded_dims(fp32: dict[str, dict[str, Any]]) -> None:
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    assert fp32["one"]["layout"][q] == {
        "shape": [128, 128],
        "tp_dim": None,
        "dp_dim": None,
        "pp_stage": 0,
    }
    assert fp32["tp"]["layout"][q]["tp_dim"] == 0 and fp32["tp"]["layout"][o]["tp_dim"] == 1
    assert fp32["dp"]["layout"][o] == {
        "shape": [128, 128],
        "tp_dim": None,
        "dp_dim": 0,
        "pp_stage": 0,
    }
    assert fp32["tp"]["layout"][o]["dp_dim"] is None
    assert fp32["dp_tp"]["layout"][o] == {
        "shape": [128, 128],
        "tp_dim": 1,
        "dp_dim": 0,
        "pp_stage": 0,
    }
    assert fp32["dp_tp"]["layout"][q] == {
        "shape": [128, 128],
        "tp_dim": 0,
        "dp_dim": 0,
        "pp_stage": 0,
    }
    assert fp32["dp_replicate"]["layout"][o] == {
        "shape": [128, 128],
        "tp_dim": None,
        "dp_dim": None,
        "pp_stage": 0,
    }


def test_export_is_a_plain_hf_model_with_the_trained_weights(
    fp32: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    export = next(tmp_path_factory.getbasetemp().glob("fp32*/tp/export"))
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    batch = token_batch(6, seed=1)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = token_log_probs(logits, batch["input_ids"])
    logp = logp * read_columns(batch["attention_mask"], batch["response_mask"])
    close(logp, fp32["tp"]["after_again"], 1e-5)


@pytest.mark.timeout(300)
def test_bf16_autocast_matches_one_rank_within_1e_2(tiny: Path, tmp_path: Path) -> None:
    """On the layout that shards both ways (dp x tp): the fp32 tests compare every layout; here
    what bf16 autocast adds is checked once (the five layouts cost twice the time)."""
    layouts = {name: LAYOUTS[name] for name in ("one", "dp_tp")}
    bf16 = scenario(tiny, "bf16", tmp_path, layouts)
    for name in ("dp_tp",):
        for key in ("log_probs", "values", "after"):
            close(bf16[name][key], bf16["one"][key], 1e-2)
