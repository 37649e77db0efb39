"""Weight transfer trainer -> rollout engines.

One contract (:mod:`.base`; its errors in ``rlplacement.errors``); what a mode is, for every other
layer (:mod:`.spec`, the ``ModeSpec`` each mode registers) and the registry of them (:mod:`.registry`);
pieces several modes share: bucketing (:mod:`.bucket`), the staging receiver every receiver builds on
(:mod:`.staging`), the framed wire of the group-based modes (:mod:`.wire`), private process groups
(:mod:`.group`), the delta codec (:mod:`.delta_codec`). One package per mode: :mod:`.broadcast`,
:mod:`.broadcast_packed`, :mod:`.p2p`, :mod:`.disk_delta`, :mod:`.cuda_ipc`.

Ray-free: the trainer actor's side and the driver-side update live in :mod:`rlplacement.runtime`.
Importing this package, the registry or a mode's package imports nothing heavy; each module imports
torch where it needs it.
"""
