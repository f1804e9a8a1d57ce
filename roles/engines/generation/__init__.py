"""Generation engines: ``interface.py`` (sampling settings and the one output contract), one file
per engine (``native.py``: hybridflow's KV-cache sampler; ``hf.py``: transformers ``generate``)
and ``serve.py``, the ``generate`` endpoint the actor and the rollout role share."""
