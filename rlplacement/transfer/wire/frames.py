"""What both ends of the framed wire share: the frame kinds of the header (the wire's table is the package
docstring), how a sender stops an update cleanly (:class:`AbortUpdate`: every receiver gets an ABORT frame and
the group stays usable), where frames live, and what an update has sent so far."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable, Iterator

from rlplacement.transfer.base import BucketManifest, NamedTensor

if TYPE_CHECKING:
    import torch

KIND_BUCKET, KIND_END, KIND_ABORT = 1, 2, 3


class AbortUpdate(Exception):
    """Stop this update cleanly: every receiver gets an ABORT frame and the group stays usable."""

    what = "update"

    def describe(self) -> str:
        return f"{self.what}: {self}"


class SourceFailed(AbortUpdate):
    """The trainer's tensor iterator raised."""

    what = "the trainer's weight source failed"


def guard(named_tensors: Iterable[NamedTensor]) -> Iterator[NamedTensor]:
    """``named_tensors`` with a failure of the trainer's source turned into :class:`SourceFailed`."""
    it = iter(named_tensors)
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except Exception as exc:
            raise SourceFailed(f"{type(exc).__name__}: {exc}") from exc
        yield item


def wire_device(backend: str, device: "torch.device") -> "torch.device":
    """Where frames and payloads live: host memory for gloo, the tensors' device for NCCL."""
    import torch

    return torch.device("cpu") if backend == "gloo" else device


@dataclasses.dataclass
class SentSoFar:
    """What an update has moved so far: counts, bytes and, with checksums on, every tensor's checksum."""

    num_tensors: int = 0
    num_buckets: int = 0
    nbytes: int = 0
    checksums: dict[str, str] | None = None

    @classmethod
    def none(cls, check_equal: bool) -> "SentSoFar":
        return cls(checksums={} if check_equal else None)

    def add(self, bucket: list[NamedTensor], manifest: BucketManifest, checksums: dict[str, str] | None = None) -> None:
        """``checksums``: what the receivers check instead of the manifest's (slices', by ``shards.region_key``)."""
        self.num_buckets += 1
        self.num_tensors += len(bucket)
        self.nbytes += sum(m.nbytes for m in manifest.tensors)
        if self.checksums is not None:
            self.checksums.update(checksums if checksums is not None else
                                  ((m.name, m.checksum) for m in manifest.tensors))
