"""Mode ``broadcast``: the framed wire (:mod:`rlplacement.transfer.wire`) with one broadcast per tensor
after each bucket's manifest, in a private group of each sending trainer rank + every engine worker (NCCL between
GPUs, gloo on CPU). The engines' loaders re-fuse and re-shard what arrives. :mod:`.sender` and
:mod:`.receiver` hold its two classes; this package registers its spec.

Slices: where engine workers keep slices (tensor-parallel engines, :mod:`rlplacement.transfer.shards`), the sender builds one more group per worker position (itself and the
workers keeping the same slices: one worker of every engine) and broadcasts each position only its slices
there; the frames stay in the group of all. Elsewhere (TP=1, pipeline-parallel or expert-parallel engines,
``--update-weight-slices off``) every worker receives every tensor whole and its loader keeps its slice.
"""

from rlplacement.transfer.registry import register_mode
from rlplacement.transfer.spec import LINK, SPLIT, BenchSpec, ModeSpec

SPEC = register_mode(ModeSpec(
    name="broadcast", sender="rlplacement.transfer.broadcast.sender:BroadcastSender",
    receiver="rlplacement.transfer.broadcast.receiver:BroadcastReceiver",
    summary="one broadcast per tensor from each sending trainer rank to every engine worker",
    layouts=frozenset({SPLIT}), named_under_colocate=True, advisor_path=LINK, bucket_staging=True,
    every_rank_sends=True,
    # source: verl's published NCCL receive rate as a share of a NIC, rounded up (shared/ANCHORS.md, verl)
    advisor_efficiency=0.2,
    # source: benchmarks/README.md, figures moved from the code (broadcast's wire rate at 8B over NVLink's)
    measured_efficiency=(("nvlink", 0.62),),
    bench=BenchSpec(ceiling="broadcast"),
    verl_backend="rlplacement_broadcast", miles_factory="broadcast"))
