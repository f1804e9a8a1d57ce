"""Training engines: ``interface.py`` (what roles program against), ``config.py`` (the typed
engine and optimizer settings), ``factory.py`` (the engine a config's ``backend`` names),
``common.py`` (what the engines share: model loading, the DTensor tp split, sums over dp,
checkpoint and export folders) and one module per engine (``fsdp.py``: FSDP2 + DTensor tp;
``megatron/``: megatron-core tp x pp x dp)."""
