"""Model-side helpers every engine shares, so engines agree: models and tokenizers
(``models.py``), text rows to token batches and back (``text.py``), the one log-prob definition
(``logprob.py``) and the policy/value/KL losses (``losses.py``)."""
