"""The rank runtime: what turns a process into a rank of a role group.

``python -m roles.runtime`` is every rank's entry point (``__main__.py``). Rank 0 runs the
``Coordinator`` (talks to the controller, fans calls out), the others run a ``Worker``; ``links``
and ``fanout`` are the ways the two reach each other; ``host`` holds a rank's role instances and
``calls`` runs one call on them; ``endpoint`` defines ``@endpoint`` and the transfer protocols;
``env`` reads a rank's place from its environment; ``device`` decides the device and collective
backend of a rank.
"""
