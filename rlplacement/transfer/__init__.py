"""Weight transfer trainer -> rollout engines: one protocol (``base``; its errors in
``rlplacement.errors``), shared bucketing (``bucket``), the staging receiver every mode's receiver
builds on (``staging``), one module per mode, each mode's options (``options``) and a registry
(``registry``). Ray-free: the trainer actor's side and the driver-side update live in
:mod:`rlplacement.runtime`. Importing this package imports nothing heavy; each module imports torch
where it needs it.
"""
