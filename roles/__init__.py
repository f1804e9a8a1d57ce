"""Role processes: everything that runs on the ranks of a role group.

- the role classes, one file each: ``actor.py`` (actor and reference), ``critic.py``,
  ``reward.py`` (rule functions and reward models; built-in rules in ``rules.py``), ``rollout.py``
  (a generation group), ``engine_role.py`` (what model-holding roles share), ``demo.py``
  (``hybridflow demo``'s linear model), ``base.py`` (``Role``, ``RoleContext``);
- ``runtime/``: the rank process itself — entry point, coordinator, workers, fan-out links,
  endpoint transfer protocols and the device seam;
- ``engines/``: training engines (``engines/training/``) and generation engines
  (``engines/generation/``) behind one interface each;
- ``modeling/``: models and tokenizers, text to tokens, the one log-prob definition, losses.

Nothing here imports ``controller/``; the controller reaches these classes only by import path.
"""
