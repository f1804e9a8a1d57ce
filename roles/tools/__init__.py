"""Tools and environments for multi-turn rollouts, and what an ``env`` role group runs them with.

A **tool** is a plain Python function with type hints and a docstring; the env role
(``roles/env.py``) names it by import path (``package.module:function``), shows the model its
schema (read from the signature and the docstring's first paragraph and ``Args:`` section:
``schema.py``), reads the model's call from the text of a turn (``calls.py``), checks the
arguments against the signature and runs it on a worker thread under a deadline (``runner.py``).
A tool returns text (or a number); anything it raises becomes an observation the model sees.
A tool can raise ``failures.ToolFailure`` (or one of its kinds) to say how a failure is counted.

An **environment** is a class with ``reset(row) -> str`` and ``step(text) -> (observation, reward,
done, info)``; the env role builds one per trajectory.

Built in, each also an example of what a user writes:

* ``calculator.py``: ``calculator(expression)``, arithmetic read with ``ast`` (never ``eval``);
* ``sandbox.py``: ``python(code)``, the code run in a separate, limited interpreter;
* ``search.py``: ``search(query)``, BM25 over a local document collection;
* ``games.py``: ``GuessNumber``, a small stateful environment.
"""
