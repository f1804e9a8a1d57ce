"""``python -m roles.runtime``: start one rank (see ``rank.py``)."""

from roles.runtime.rank import main

main()
