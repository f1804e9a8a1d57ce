"""LoRA on the fsdp engine (``roles/modeling/lora.py``), through real role groups.

One session, the tiny model in fp32: a LoRA actor on 2 dp ranks (FSDP-sharded) beside a plain
frozen reference of the same model, the same LoRA actor on 1 rank beside another plain reference,
and a LoRA rollout group on 1 rank. Both actors take the same steps; the rollout group gets only
the adapters from the 2-rank actor. What must hold: a fresh adapter is the base model bitwise;
adapters switched off are the base model bitwise after training; 1 and 2 ranks agree; the
generator answers as the trainer does after an adapter-only sync, which moves only adapter
bytes; a checkpoint holds the adapters alone and replays bitwise; the merged export and the PEFT
adapter folder both give the trained model's outputs in plain Hugging Face code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from controller.clients import ActorClient, CriticClient, ReferenceClient, RolloutClient
from controller.sync import WeightSync
from deploy.session import local_session
from roles.modeling.logprob import read_columns, token_log_probs
from roles.modeling.lora import adapter_folder, is_adapter
from roles.modeling.models import init_model
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.roles.test_training import POLICY_LOSS, token_batch
from transport.batch import TensorBatch
from transport.protocol import PEAK_MEMORY
from transport.weight_sync import WeightSyncSettings

LORA = {"rank": 4, "alpha": 8}
PROMPTS = ["1+2=", "34+56=", "7+80=", "a longer prompt, 99+1=", "0+0=", "5+5="]
GREEDY = {"temperature": 0, "max_new_tokens": 10}


def prompts() -> TensorBatch:
    return TensorBatch.from_dict(non_tensors={"prompt": list(PROMPTS)})


def batch_of(step: int, logp: torch.Tensor) -> TensorBatch:
    batch = token_batch(6, seed=100 + step)
    extra = {"old_log_probs": logp, "ref_log_probs": logp - 0.05}
    return batch.union(TensorBatch.from_dict(extra))


async def train(actor: ActorClient, steps: range, logp: torch.Tensor) -> dict[str, Any]:
    metrics = []
    for step in steps:
        found = await actor.update_policy(batch_of(step, logp), loss=POLICY_LOSS)
        metrics.append({k: v for k, v in found.items() if k != PEAK_MEMORY})
    scored = (await actor.compute_log_prob(token_batch(6, seed=1)))["log_probs"]
    return {"metrics": metrics, "log_probs": scored}


async def scenario(c: Any, root: Path) -> dict[str, Any]:
    actor, one = ActorClient(c, "actor"), ActorClient(c, "actor_one")
    base, base_one = ReferenceClient(c, "base"), ReferenceClient(c, "base_one")
    rollout = RolloutClient(c, "rollout")
    batch = token_batch(6, seed=1)
    out: dict[str, Any] = {
        "fresh": (await one.compute_log_prob(batch))["log_probs"],
        "fresh_base": (await base_one.compute_log_prob(batch))["log_probs"],
        "layout": await actor.param_layout(),
    }
    logp = out["fresh"]
    out["two"] = await train(actor, range(1, 4), logp)
    out["one"] = await train(one, range(1, 4), logp)
    out["ref"] = (await actor.compute_ref_log_prob(batch))["log_probs"]
    out["base"] = (await base.compute_log_prob(batch))["log_probs"]
    # an RL stage starts here (after "SFT"): the reference becomes the actor as it is now
    await actor.rebase_reference()
    out["rebased"] = (await actor.compute_ref_log_prob(batch))["log_probs"]
    out["rebased_actor"] = (await actor.compute_log_prob(batch))["log_probs"]
    # a separate reference with the same adapters takes the actor's, strictly
    lora_ref = ReferenceClient(c, "lora_ref")
    out["ref_sync"] = await WeightSync(actor, WeightSyncSettings()).push(lora_ref, 1, strict=True)
    out["lora_ref"] = (await lora_ref.compute_log_prob(batch))["log_probs"]
    # adapter-only sync: the rollout group answers as the actor does
    settings = WeightSyncSettings(bucket_mb=1)
    out["sync"] = await WeightSync(actor, settings).push(rollout, 1)
    out["actor_greedy"] = await actor.generate(prompts(), GREEDY)
    out["rollout_greedy"] = await rollout.generate(prompts(), GREEDY, min_version=1)
    sampled = await rollout.generate(prompts(), {"n": 2, "max_new_tokens": 8}, min_version=1)
    out["sampled"], out["scored"] = sampled, await actor.compute_log_prob(sampled)
    # a checkpoint of adapters and their optimizer state replays exactly
    ckpt = root / "ckpt"
    await actor.save(str(ckpt))
    out["ckpt"] = ckpt
    out["on"] = await train(actor, range(4, 6), logp)
    out["ref_later"] = (await actor.compute_ref_log_prob(batch))["log_probs"]
    await actor.rebase_reference()  # on the trained adapters; the checkpoint has the earlier
    out["loaded_at"] = await actor.load(str(ckpt))
    out["ref_loaded"] = (await actor.compute_ref_log_prob(batch))["log_probs"]
    out["replayed"] = await train(actor, range(4, 6), logp)
    out["export"] = await actor.export(str(root / "export" / "actor"))
    # a critic with its own adapters: the value head trains whole, the base stays
    critic = CriticClient(c, "critic")
    values = (await critic.compute_values(batch))["values"]
    for _ in range(2):
        await critic.update_critic(batch.union(TensorBatch.from_dict({"values": values})))
    out["critic"] = {
        "values": values,
        "after": (await critic.compute_values(batch))["values"],
        "layout": await critic.param_layout(),
    }
    out["trained"] = (await actor.compute_log_prob(batch))["log_probs"]
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def recorded(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora")
    engine = {"model": str(model), "dtype": "fp32", "micro_batch_size": 2}
    lora = {**engine, "optim": {"lr": 1e-2}, "lora": LORA}
    frozen = {**engine, "optim": None}
    placement = [
        group("a", 2, actor=("roles.actor:Actor", lora), base=("roles.actor:Reference", frozen)),
        group(
            "o",
            1,
            actor_one=("roles.actor:Actor", lora),
            base_one=("roles.actor:Reference", frozen),
        ),
        group("r", 1, rollout=("roles.rollout:Rollout", {"model": str(model), "lora": LORA})),
        group(
            "c",
            1,
            critic=("roles.critic:Critic", lora),
            lora_ref=("roles.actor:Reference", {**frozen, "lora": LORA}),
        ),
    ]

    async def main() -> dict[str, Any]:
        async with local_session(placement, TEST_TIMEOUTS) as c:
            return await scenario(c, root)

    found: dict[str, Any] = run(main)
    found["root"] = root
    return found


def test_a_fresh_adapter_is_the_base_model_bitwise(recorded: dict[str, Any]) -> None:
    assert torch.equal(recorded["fresh"], recorded["fresh_base"])


def test_adapters_off_are_the_base_model_bitwise_after_training(recorded: dict[str, Any]) -> None:
    assert torch.equal(recorded["ref"], recorded["base"])
    moved = (recorded["two"]["log_probs"] - recorded["base"]).abs().max()
    assert moved > 0.05  # the adapters did learn something


def test_a_rebased_reference_is_the_actor_at_the_rl_stage_start_and_stays_there(
    recorded: dict[str, Any],
) -> None:
    """After SFT the KL is measured from the SFT model: just after ``rebase_reference`` the
    reference's log-probs are the actor's bitwise; they stay put while the actor trains on, and
    a checkpoint written after the re-basing brings them back."""
    assert torch.equal(recorded["rebased"], recorded["rebased_actor"])
    assert not torch.equal(recorded["rebased"], recorded["ref"])  # not the base model
    assert torch.equal(recorded["ref_later"], recorded["rebased"])
    assert not torch.equal(recorded["on"]["log_probs"], recorded["rebased"])  # the actor moved
    assert torch.equal(recorded["ref_loaded"], recorded["rebased"])


def test_a_lora_reference_takes_the_actors_adapters_and_answers_as_it(
    recorded: dict[str, Any],
) -> None:
    """A LoRA actor's push carries adapters only; a reference with the same lora block takes
    them strictly (its base is the same model folder) and then computes what the actor does."""
    received = recorded["ref_sync"]["received"]
    assert 0 < received["bytes"] < 200_000  # adapters of a 0.6M model, not the whole of it
    torch.testing.assert_close(recorded["lora_ref"], recorded["rebased_actor"], atol=1e-5, rtol=0)


def test_one_rank_and_two_fsdp_ranks_train_alike(recorded: dict[str, Any]) -> None:
    one, two = recorded["one"], recorded["two"]
    for a, b in zip(one["metrics"], two["metrics"], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
    torch.testing.assert_close(one["log_probs"], two["log_probs"], atol=1e-5, rtol=0)


def test_the_sync_carries_only_the_adapters(recorded: dict[str, Any]) -> None:
    layout = recorded["layout"]
    adapters = {n: s for n, s in layout.items() if is_adapter(n)}
    assert adapters and len(adapters) < len(layout)
    adapter_bytes = sum(4 * torch.Size(s["shape"]).numel() for s in adapters.values())
    every_bytes = sum(4 * torch.Size(s["shape"]).numel() for s in layout.values())
    received = recorded["sync"]["received"]["bytes"]
    assert received == adapter_bytes
    assert received < 0.05 * every_bytes


def test_after_an_adapter_sync_the_generator_answers_as_the_trainer(
    recorded: dict[str, Any],
) -> None:
    ours, theirs = recorded["rollout_greedy"], recorded["actor_greedy"]
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert torch.equal(ours["response_mask"], theirs["response_mask"])
    torch.testing.assert_close(ours["log_probs"], theirs["log_probs"], atol=1e-4, rtol=0)
    # the generator's log-probs are the trainer's on the same tokens, as without LoRA
    sampled, scored = recorded["sampled"], recorded["scored"]
    expected = scored["log_probs"] * sampled["response_mask"]
    torch.testing.assert_close(sampled["log_probs"], expected, atol=1e-5, rtol=0)


def test_a_checkpoint_holds_the_adapters_and_resumes_bitwise(recorded: dict[str, Any]) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(recorded["ckpt"])).read_metadata().state_dict_metadata
    model = [k.removeprefix("model.") for k in saved if k.startswith("model.")]
    moments = [k for k in saved if k.startswith("optim.state.")]
    assert model and all(is_adapter(k) for k in model)  # not the frozen base
    assert moments and all(".lora_" in k for k in moments)
    assert recorded["loaded_at"] == 3
    assert recorded["replayed"]["metrics"] == recorded["on"]["metrics"]
    assert torch.equal(recorded["replayed"]["log_probs"], recorded["on"]["log_probs"])


def _hf_log_probs(module: torch.nn.Module, batch: TensorBatch) -> torch.Tensor:
    ids, mask = batch.tensor("input_ids"), batch.tensor("attention_mask")
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = module(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    return token_log_probs(logits, ids, 1.0) * read_columns(
        mask, batch.tensors.get("response_mask")
    )


def test_the_merged_export_and_the_peft_folder_give_the_trained_model(
    recorded: dict[str, Any], model: Path
) -> None:
    import peft
    from transformers import AutoModelForCausalLM

    merged_dir = Path(recorded["export"])
    adapter_dir = adapter_folder(merged_dir)
    assert (adapter_dir / "adapter_config.json").exists()
    assert not (merged_dir / "adapter_config.json").exists()  # else transformers applies it again
    batch, trained = token_batch(6, seed=1), recorded["trained"]
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    torch.testing.assert_close(_hf_log_probs(merged, batch), trained, atol=1e-5, rtol=0)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    torch.testing.assert_close(_hf_log_probs(adapted, batch), trained, atol=1e-5, rtol=0)


def test_the_native_generator_merges_as_peft_computes(model: Path) -> None:
    """Adapters merged into the generator's fused weights per call, PEFT's layers run at every
    step, and the trainer-side module itself agree on greedy tokens and log-probs; the merge
    leaves the base weights untouched."""
    from roles.engines.generation.native import NativeEngine
    from roles.modeling.lora import LoraSettings, attach
    from roles.modeling.models import load_causal_lm, load_tokenizer
    from transport.sampling import SamplingConfig

    module, tokenizer = load_causal_lm(model).eval(), load_tokenizer(model)
    torch.manual_seed(0)
    attach(module, LoraSettings(rank=4, alpha=8))
    with torch.no_grad():
        for name, param in module.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.05)
    base = {n: p.clone() for n, p in module.named_parameters() if "base_layer" in n}
    prompts = [[tokenizer.bos_token_id, *tokenizer.encode(p)] for p in PROMPTS]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=8)
    merged = NativeEngine(module, tokenizer.eos_token_id).generate(prompts, sampling)
    runtime = NativeEngine(module, tokenizer.eos_token_id, lora_at_runtime=True)
    at_runtime = runtime.generate(prompts, sampling)
    for a, b in zip(merged, at_runtime, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(
            torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5, rtol=0
        )
    assert all(torch.equal(p, base[n]) for n, p in module.named_parameters() if n in base)
    # and the module's own forward (the trainer's) picks the same first tokens
    with torch.no_grad():
        firsts = [int(module(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
    assert firsts == [s.tokens[0] for s in merged]


def test_a_critic_trains_its_adapters_and_its_value_head(recorded: dict[str, Any]) -> None:
    critic = recorded["critic"]
    assert (critic["after"] - critic["values"]).abs().max() > 1e-3
    trained = [n for n in critic["layout"] if is_adapter(n) or n.startswith("score.")]
    assert any(n.startswith("score.") for n in trained) and any(is_adapter(n) for n in trained)
