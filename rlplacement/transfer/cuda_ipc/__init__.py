"""Mode ``cuda_ipc``: the colocated path (``--colocate``): the trainer and the engine workers share the
GPU(s), so a bucket is handed over as a memory handle instead of being sent. With several trainer ranks
each worker takes the update from the rank on its own GPU, in a group of two (``ModeSpec.reads_own_gpu``,
:mod:`rlplacement.transfer.multi_sender`); a slot's descriptor names its GPU, and each receiver counts the
bytes it read per GPU (``read_from``).

Per bucket the sender packs the flat buffer (``bucket.pack_into``) into one of two exportable
slot buffers (``buckets.SharedSlots``: CUDA IPC on GPU, a /dev/shm mapping on CPU) and
broadcasts the bucket's JSON manifest with the slot's handle descriptor; each receiver opens the
handle (once per slot buffer, kept open across buckets and updates), copies the bucket into its
own staging buffer, checks checksums, and acknowledges. The sender refills a slot only after
every receiver acknowledged the bucket last in it, so packing bucket i+1 overlaps the receivers
copying bucket i.

Control channel: the private gloo group of ``group.py`` (manifests as broadcasts from rank 0,
acknowledgements as one small all-reduce per bucket: an int32 per rank, non-zero where that
rank failed; a direct update's as one int32 message from each receiver, half an all-reduce's
latency). It is CPU-side, so it works on both devices; NCCL is not an option here anyway, since
it refuses two ranks on one GPU, and a Ray round-trip per bucket would cost ~ms. Every wait is
bounded by the group's timeout, and a dead peer breaks the group at once.

All or nothing across engines: a receiver that fails on a bucket (cannot open the handle, copy
fails, checksum differs) keeps acknowledging with its failure flag set; the sender then stops
and broadcasts ABORT, so every engine keeps its previous version whole and the group stays
usable. The failing receiver raises its own error, the others ``UpdateAborted`` naming its rank.

Direct path (:mod:`.direct`): when the trainer's tensors are resident (``update(..., resident=True)``)
and exportable, one DIRECT frame carries a manifest of the trainer's own allocations instead of
buckets. Receivers map them, verify (with check_equal the trainer sends its checksums in a frame of
their own after the manifest, so both sides hash at once), and acknowledge (all or nothing, as above); after END each
receiver commits straight from the trainer's memory, unmaps, and acknowledges once more, and only
then does the sender's ``update`` return: the trainer's weights must not change or be freed while
an engine reads them. A receiver that drops the staged update instead (``abort``, a refused
validation) acknowledges with its failure flag; the sender raises ``UpdateRefused`` naming it,
while the others serve the new version.

Steady state (``KIND_DIRECT_COMMIT``): when the manifest is the one every receiver mapped and kept
at the last update (``keep_mapped``, nothing moved, no checksums to compare), there is nothing left
that could fail for one receiver and not another before the commit, so the first round (map,
acknowledge, END) is skipped: receivers commit at once and acknowledge once. A receiver that still
cannot commit keeps its version and says so in that acknowledgement (``UpdateRefused``, as above).

Wire (the framed wire of :mod:`rlplacement.transfer.wire`, plus three kinds of its own):

| frame | from | carries |
|---|---|---|
| ``KIND_BUCKET`` (1) | trainer | a bucket's manifest with its slot buffer's handle (``"payload"``); receivers copy, then all-reduce one int32 flag each |
| ``KIND_END`` (2) | trainer | the tensor count: the update is whole |
| ``KIND_ABORT`` (3) | trainer | why: a receiver failed (its flag) or the trainer's weight source failed |
| ``KIND_DIRECT`` (4) | trainer | a manifest of the trainer's own allocations (``direct``); receivers map, verify, send one int32 each (tag ``DIRECT_ACK_TAG``) |
| ``KIND_CHECKSUMS`` (5) | trainer | after a direct manifest, with check_equal: the trainer's per-tensor checksums |
| ``KIND_DIRECT_COMMIT`` (6) | trainer | the manifest every receiver holds mapped: commit at once, acknowledge once |

Package: :mod:`.protocol` (the kinds and the acknowledgements), :mod:`.buckets` (the exportable slot
buffers: CUDA IPC handles, /dev/shm on CPU), :mod:`.direct` (the trainer's allocations exported and
mapped), :mod:`.driver` (the CUDA driver calls the direct path needs), :mod:`.sender` and
:mod:`.receiver` (each side's dispatch between the two paths). This package registers the spec.

Slices: a direct update's loader reads only its worker's slice out of the trainer's memory, so only that
slice is copied; the bucket path copies every bucket whole into each worker's staging first.
"""

from rlplacement.transfer.registry import register_mode
from rlplacement.transfer.spec import COLOCATE, IPC, BenchSpec, ModeSpec

SPEC = register_mode(ModeSpec(
    name="cuda_ipc", sender="rlplacement.transfer.cuda_ipc.sender:IpcSender",
    receiver="rlplacement.transfer.cuda_ipc.receiver:IpcReceiver",
    summary="--colocate: buckets (or the trainer's own memory) handed to engines on the same GPU by CUDA IPC "
            "handles (/dev/shm on CPU)",
    layouts=frozenset({COLOCATE}), advisor_path=IPC, reads_own_gpu=True,
    # source: benchmarks/README.md, figures moved from the code (the whole update over an in-GPU copy, rounded up)
    advisor_efficiency=0.5,
    # source: benchmarks/README.md, figures moved from the code (cuda_ipc's read rate at 8B over the IPC copy rate)
    measured_efficiency=(("ipc", 0.67),),
    bench=BenchSpec(ceiling="copy", device="same", transport={"cpu": "shared memory", "cuda": "cuda ipc"},
                    resident=True, copies_at_commit=True)))
