"""The ``megatron`` training engine (megatron-core, an optional extra): ``engine.py`` (the engine),
``model.py`` (GPTModel from a Hugging Face Llama config, megatron's parallel state),
``convert.py`` (HF <-> megatron weights per rank), ``rows.py`` (left-aligned rows for RoPE) and
``cuda_shim.py`` (what megatron-core needs on CPU ranks). The factory
(``roles/engines/training/factory.py``) imports this package only when a role asks for it."""

from roles.engines.training.megatron.engine import MegatronEngine

__all__ = ["MegatronEngine"]
