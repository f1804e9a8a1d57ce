"""Export of a model with tied input/output embeddings (as SmolLM2 has) from a dp = 2 group."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from controller.clients import ActorClient
from deploy.session import local_session
from roles.modeling.logprob import read_columns, token_log_probs
from roles.modeling.models import build_tokenizer
from tests.conftest import TEST_TIMEOUTS, group, run
from tests.roles.test_training import token_batch
from transport.batch import TensorBatch


def tied_model(path: Path) -> Path:
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_tied_embeddings_survive_training_and_export(tmp_path: Path) -> None:
    model = tied_model(tmp_path / "tied")
    batch = token_batch(4, seed=5)

    async def main() -> torch.Tensor:
        config = {"model": str(model), "micro_batch_size": 2, "optim": {"lr": 1e-2}}
        async with local_session(
            [group("g", 2, actor=("roles.actor:Actor", config))], TEST_TIMEOUTS
        ) as c:
            actor = ActorClient(c, "actor")
            old = (await actor.compute_log_prob(batch))["log_probs"]
            step = batch.union(TensorBatch.from_dict({"old_log_probs": old}))
            await actor.update_policy(step)
            await actor.export(str(tmp_path / "export"))
            trained: torch.Tensor = (await actor.compute_log_prob(batch))["log_probs"]
            assert (trained - old).abs().max() > 1e-3
            return trained

    trained = run(main)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    weights = exported.get_output_embeddings().weight
    assert weights.data_ptr() == exported.get_input_embeddings().weight.data_ptr()
    with torch.no_grad():
        logits = exported(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
    logp = token_log_probs(logits, batch["input_ids"])
    logp = logp * read_columns(batch["attention_mask"], batch["response_mask"])
    torch.testing.assert_close(logp, trained, atol=1e-5, rtol=0)
