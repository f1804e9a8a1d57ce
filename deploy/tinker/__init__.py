"""The Tinker REST API in front of the mesh (``hybridflow serve``): ``wire`` reads and writes
Tinker's formats, ``service`` runs each call on a training client's ``Mesh``, ``app`` serves the
routes the ``tinker`` SDK calls."""
