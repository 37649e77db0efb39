"""Mode ``broadcast_packed``: the ``broadcast`` wire with one broadcast of the whole flat bucket
instead of one per tensor (mixed dtypes share the uint8 buffer; offsets are in the manifest).

The sender packs into two buffers it keeps across updates and alternates between them: bucket
i+1 is packed (before its header is sent) while bucket i is on the wire; a slot is reused only
after its broadcast has completed. The receiver receives straight into its staging buffer, so each
bucket costs one collective and no copy on that side. This package registers its spec.

Slices, as ``broadcast``: where workers keep slices, a slot holds one region per worker position, each
broadcast in that position's own group; elsewhere every engine worker receives every bucket whole.
"""

from rlplacement.transfer.registry import register_mode
from rlplacement.transfer.spec import LINK, SPLIT, BenchSpec, ModeSpec

SPEC = register_mode(ModeSpec(
    name="broadcast_packed", sender="rlplacement.transfer.broadcast_packed.sender:PackedBroadcastSender",
    receiver="rlplacement.transfer.broadcast_packed.receiver:PackedBroadcastReceiver",
    summary="one broadcast per bucket (the flat packed buffer) from each sending trainer rank to every engine worker",
    layouts=frozenset({SPLIT}), named_under_colocate=True, advisor_path=LINK, bucket_staging=True,
    every_rank_sends=True,
    # source: benchmarks/README.md, figures moved from the code (the whole update over a flat NCCL broadcast,
    # rounded down)
    advisor_efficiency=0.5,
    # source: benchmarks/README.md, figures moved from the code (the wire rate at 8B over NVLink's)
    measured_efficiency=(("nvlink", 0.74),),
    bench=BenchSpec(ceiling="broadcast"),
    verl_backend="rlplacement_broadcast_packed", miles_factory="broadcast_packed"))
