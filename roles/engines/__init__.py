"""Engines: the heavy computation behind a role, swappable per role in the experiment config.

``training/`` holds the training-engine interface and one file per engine (``fsdp.py``);
``generation/`` the generation-engine interface, its output contract and one file per engine
(``native.py``, ``hf.py``). A new engine is a new file next to those, implementing the interface.
"""
