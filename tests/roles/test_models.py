"""Model directories: byte tokenizer, init/reload, the checks both engines share, GGUF import."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from deploy.commands.model import add_model_commands, run_model_command
from roles.modeling.models import (
    ModelError,
    build_tokenizer,
    count_parameters,
    find_smollm2_gguf,
    import_gguf,
    init_model,
    load_causal_lm,
    load_gguf,
    load_tokenizer,
    save_loaded,
)

TRICKY = [
    "",
    " ",
    "  two  spaces  ",
    "line\n\nbreaks\r\n\tand tabs\n",
    "12 + 345 = 357",
    "a , b . c ? don 't",
    "héllo wörld — ünïcode ✓ 🤖 日本語",
    "<s> looks special </s>",
]


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_model_commands(parser.add_subparsers(dest="command"))
    return run_model_command(parser.parse_args(["model", *argv]))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=1)


@pytest.mark.parametrize("text", TRICKY)
def test_tokenizer_round_trips(text: str) -> None:
    tokenizer = build_tokenizer()
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text.replace(
        "<s>", ""
    ).replace("</s>", "")


def test_tokenizer_is_bytes_and_adds_bos_as_training_rows_start() -> None:
    tokenizer = build_tokenizer()
    plain = tokenizer.encode("0123456789", add_special_tokens=False)
    assert plain == list(range(48, 58))  # each digit its own token
    assert tokenizer.encode("é", add_special_tokens=False) == list("é".encode())
    assert len(tokenizer) == 259
    ids = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert ids == (256, 257, 258)
    # what plain Hugging Face code gets: <s> first, as every training row (roles/modeling/text.py)
    assert tokenizer("0123456789")["input_ids"] == [257, *plain]
    assert tokenizer("12", "34")["input_ids"] == [257, 49, 50, 51, 52]  # prompt + response
    assert tokenizer.padding_side == "left"  # decoder-only generation pads on the left
    batch = tokenizer(["1", "123"], padding=True)["input_ids"]
    assert batch == [[256, 256, 257, 49], [257, 49, 50, 51]]


def test_tokenizer_reloads_by_path(tiny_dir: Path) -> None:
    built, loaded = build_tokenizer(), AutoTokenizer.from_pretrained(tiny_dir)
    for text in TRICKY:
        assert loaded.encode(text) == built.encode(text)
        assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text
    assert loaded.eos_token_id == built.eos_token_id and loaded.pad_token_id == built.pad_token_id
    chat = [{"role": "user", "content": "2+2?"}]
    prompt = loaded.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt == "<s>user: 2+2?\nassistant: "
    ids = loaded.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert ids == loaded(prompt, add_special_tokens=False)["input_ids"]  # one BOS, not two
    assert ids == loaded("user: 2+2?\nassistant: ")["input_ids"]
    assert load_tokenizer(tiny_dir).encode("x 1") == built.encode("x 1")


@pytest.mark.parametrize(("size", "low", "high"), [("tiny", 0.8e6, 1.3e6), ("small", 15e6, 25e6)])
def test_init_sizes(tmp_path: Path, size: str, low: float, high: float) -> None:
    model = load_causal_lm(init_model(tmp_path / size, size))  # type: ignore[arg-type]
    assert low <= count_parameters(model) <= high
    config = model.config
    assert config.vocab_size % 64 == 0 and not config.tie_word_embeddings
    for n in (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size):
        assert n % 2 == 0  # tp=2 splits them
    assert model.generation_config.eos_token_id == 258 and model.dtype == torch.float32


def test_reload_is_bit_identical(tmp_path: Path, tiny_dir: Path) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        fresh = LlamaForCausalLM(AutoConfig.from_pretrained(tiny_dir)).eval()
    loaded = load_causal_lm(tiny_dir)
    assert fresh.state_dict().keys() == loaded.state_dict().keys()
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    ids = torch.tensor([build_tokenizer().encode("12+30=42\n")])
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, loaded(ids).logits)
    again = load_causal_lm(init_model(tmp_path / "again", "tiny", seed=1))
    other = load_causal_lm(init_model(tmp_path / "other", "tiny", seed=2))
    embed = "model.embed_tokens.weight"
    assert torch.equal(again.state_dict()[embed], loaded.state_dict()[embed])
    assert not torch.equal(other.state_dict()[embed], loaded.state_dict()[embed])


def no_dir(tmp: Path, tiny: Path) -> Path:
    return tmp / "missing"


def no_config(tmp: Path, tiny: Path) -> Path:
    (tmp / "empty").mkdir()
    return tmp / "empty"


def edited_config(**changes: object) -> Callable[[Path, Path], Path]:
    def make(tmp: Path, tiny: Path) -> Path:
        config = json.loads((tiny / "config.json").read_text()) | changes
        (tmp / "bad").mkdir()
        for file in tiny.iterdir():
            (tmp / "bad" / file.name).write_bytes(file.read_bytes())
        (tmp / "bad" / "config.json").write_text(json.dumps(config))
        return tmp / "bad"

    return make


BAD_DIRS = {
    "no_dir": (no_dir, "no model directory at"),
    "no_config": (no_config, "has no config.json"),
    "gpt2": (edited_config(model_type="gpt2"), "model_type 'gpt2' is not supported; supported"),
    "vocab": (edited_config(vocab_size=200), "259 tokens but the model's vocab_size is 200"),
}


@pytest.mark.parametrize("case", BAD_DIRS)
def test_bad_model_dirs_are_refused(
    case: str, tmp_path: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make, message = BAD_DIRS[case]
    path = make(tmp_path, tiny_dir)
    for load in (load_causal_lm, load_tokenizer):
        with pytest.raises(ModelError, match=message):
            load(path)
    assert cli("check", str(path)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_other_supported_architectures_load(tmp_path: Path, model_type: str) -> None:
    config = AutoConfig.for_model(
        model_type,
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=1,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    assert type(load_causal_lm(tmp_path)).__name__.lower().startswith(model_type)


def test_out_dir_is_never_clobbered_silently(tmp_path: Path, tiny_dir: Path) -> None:
    with pytest.raises(ModelError, match="not empty; choose another path or pass --overwrite"):
        init_model(tiny_dir, "tiny")
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ModelError, match="holds no model"):
        init_model(tmp_path, "tiny", overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    with pytest.raises(ModelError, match="unknown model size 'huge'"):
        init_model(tmp_path / "huge", "huge")  # type: ignore[arg-type]


def test_cli_init(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("init", str(tmp_path / "m"), "--size", "tiny", "--seed", "3") == 0
    assert capsys.readouterr().out == f"{tmp_path / 'm'}: 1,066,112 parameters\n"
    assert cli("init", str(tmp_path / "m"), "--size", "tiny") == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli("init", str(tmp_path / "m"), "--size", "tiny", "--overwrite") == 0


def test_non_gguf_files_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "model.gguf"
    text.write_text("not a model")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(find_smollm2_gguf().read_bytes()[:4096])
    for path, message in [
        (text, "is not a GGUF file"),
        (tmp_path / "missing.gguf", "no GGUF file at"),
        (truncated, "cannot read the GGUF file"),
    ]:
        with pytest.raises(ModelError, match=message):
            import_gguf(tmp_path / "out", path)
        assert cli("import-gguf", str(tmp_path / "out"), "--gguf", str(path)) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_import_smollm2_gguf(tmp_path: Path) -> None:
    import gguf

    # import_gguf is load_gguf then save_loaded; loading the file once (16 s) serves both sides
    original, its_tokenizer = load_gguf(find_smollm2_gguf())
    out = save_loaded(original, its_tokenizer, tmp_path / "smollm2")
    model, tokenizer = load_causal_lm(out), load_tokenizer(out)
    assert count_parameters(model) == 134_515_008
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    # The embedding equals gguf's own de-quantisation of the file (independent of transformers).
    reader = gguf.GGUFReader(find_smollm2_gguf())
    raw = next(t for t in reader.tensors if t.name == "token_embd.weight")
    expected = torch.from_numpy(gguf.dequantize(raw.data, raw.tensor_type).copy())
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], expected.float())
    # The safetensors copy computes what the GGUF-loaded model computes.
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    # Plain calls give what training rows hold: [bos, *text] (its bos is <|im_start|>, which
    # its chat template already starts with: no second one), padded on the left.
    assert tokenizer.bos_token == "<|im_start|>" and ids[0, 0] == tokenizer.bos_token_id
    assert ids[0, 1] != tokenizer.bos_token_id
    text = prompt.removeprefix("<|im_start|>")
    assert tokenizer(text)["input_ids"] == ids[0].tolist()
    assert tokenizer.padding_side == "left"
    with torch.no_grad():
        want, got = original(ids).logits[0, -1], model(ids).logits[0, -1]
    torch.testing.assert_close(got, want)
    assert got.argmax() == want.argmax()
