"""The FSDP2 trainer backend (``--train-backend fsdp``): :class:`.backend.FSDPBackend`.

Importing this package imports nothing heavy: the backend registry names
``rlplacement.backends.fsdp.backend:FSDPBackend`` and imports it (and torch) only when chosen.
"""
