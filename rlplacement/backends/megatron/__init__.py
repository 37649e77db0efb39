"""The megatron-core trainer backend (``--train-backend megatron``): :class:`.backend.MegatronBackend`.

Importing this package imports nothing heavy (no torch, no megatron-core): the backend registry names
``rlplacement.backends.megatron.backend:MegatronBackend`` and imports it only when chosen, and the
torch-free checkpoint layout (:mod:`.checkpoint_layout`) is read by preflight before any trainer starts.
"""
