"""Auto-mapping (``hybridflow plan``, docs/plan.md): the paper's §6 algorithm.

``profiles``: the cost constants per device kind; ``cost``: a step's time and memory for a group
of colocated models under one parallel strategy; ``search``: set partitions x device
allocations x strategies, ranked by predicted step time. The command is ``deploy/commands/plan.py``.
"""
