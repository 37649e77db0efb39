"""The framed wire four modes share (``broadcast``, ``broadcast_packed``, ``p2p``, ``cuda_ipc``): a
private group of one sending trainer rank + every engine worker (one group per sender where several
send: :mod:`rlplacement.transfer.multi_sender`), control frames as broadcasts from the sender, and
the frame loop on both sides. A mode subclasses :class:`FramedSender` and :class:`FramedReceiver` and
changes how one bucket's bytes travel (``_send_payload`` / ``_recv_payload``) and, where it must
answer per bucket, ``_take_bucket``.

By role: ``frames`` (the frame kinds, how a sender stops an update, what an update has sent), ``sender``
(:class:`FramedSender`, a sending trainer rank), ``receiver`` (:class:`FramedReceiver`, one engine worker).
The package's names are the wire's public API; a mode imports them from here.

Wire, per update and sender (every frame is a broadcast from the sender, the group's rank 0):

| frame | header int64[4] = (kind, version, manifest_len, aux) | then |
|---|---|---|
| :data:`KIND_BUCKET` | aux = the bucket's padded bytes | its JSON manifest as uint8 (empty when the group holds this very manifest for this bucket index), then the mode's payload |
| :data:`KIND_END` | aux = tensors sent | nothing: the update is off the wire |
| :data:`KIND_ABORT` | aux = 0 | the reason as UTF-8: the trainer's weight source failed, or a receiver said it could not stage |

Kinds 4-6 belong to ``cuda_ipc`` (its package docstring has them). Receivers drain to END even after
spotting a checksum mismatch, so one engine's refusal never stalls the group for the others; they
raise only once the update is fully off the wire. :class:`AbortUpdate` is how a sender stops an
update cleanly: every receiver gets an ABORT frame and the group stays usable.

Slices (:mod:`rlplacement.transfer.shards`): a receiver that keeps slices publishes them in the group's store
at join; a sender that sends slices (``sends_slices``) reads every receiver's at connect and groups the
receivers by what they keep (its *positions*). A mode that broadcasts payloads (``groups_per_position``) then
builds one more group per position, of the sender and that position's workers, and broadcasts each region
there; control frames stay in the group of all. Where all receivers keep the same (every worker whole), the
group of all carries the payloads as well.
"""

from rlplacement.transfer.wire.frames import (KIND_ABORT, KIND_BUCKET, KIND_END, AbortUpdate, SentSoFar, SourceFailed,
                                              guard, wire_device)
from rlplacement.transfer.wire.receiver import FramedReceiver
from rlplacement.transfer.wire.sender import FramedSender

__all__ = ["KIND_ABORT", "KIND_BUCKET", "KIND_END", "AbortUpdate", "FramedReceiver", "FramedSender", "SentSoFar",
           "SourceFailed", "guard", "wire_device"]
