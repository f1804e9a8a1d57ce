"""Training engines: ``interface.py`` (what roles program against), ``config.py`` (the typed
engine and optimizer settings) and one file per engine (``fsdp.py``: FSDP2 + DTensor tp)."""
