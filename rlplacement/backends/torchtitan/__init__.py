"""The torchtitan trainer backend (``--train-backend torchtitan``): :class:`.backend.TorchtitanBackend`.

Importing this package imports nothing heavy: the backend registry names
``rlplacement.backends.torchtitan.backend:TorchtitanBackend`` and imports it (torch, and torchtitan
where it runs) only when chosen.
"""
