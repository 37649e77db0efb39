"""Why a weight update did not complete; a leaf module (no torch, no other rlplacement import) so
the driver, the engines and the loop can catch these without importing a transfer mode.
:mod:`rlplacement.transfer.base` re-exports every name here as part of the transfer contract.
"""

from __future__ import annotations


class TransferError(RuntimeError):
    """A weight update that did not complete; the receiver keeps its previous version.

    Every error here survives pickling (subclasses with their own fields define ``__reduce__``):
    they cross Ray and vLLM's engine-core RPC, and one that cannot be rebuilt reaches the user as
    "Failed to deserialize exception" with the tensor's name lost.
    """


class UpdateAborted(TransferError):
    """The trainer stopped an update on purpose (its weight source failed) and told the engines."""


class WeightMismatchError(TransferError):
    """--check-weight-update-equal found a tensor whose checksum differs between the two sides."""

    def __init__(self, name: str, expected: str, got: str, where: str = ""):
        self.name, self.expected, self.got = name, expected, got
        self.where = where
        super().__init__(f"weight mismatch{(' on ' + where) if where else ''}: tensor {name!r} has "
                         f"checksum {got} but the trainer sent {expected}")

    def __reduce__(self):  # rebuilt from its fields on the other side of Ray or vLLM's RPC
        return type(self), (self.name, self.expected, self.got, self.where)


class WeightUpdateError(TransferError):
    """An update across trainer + engines failed; names the first engine (or the trainer) and why."""

    def __init__(self, version: int, failures: dict[str, str]):
        self.version, self.failures = version, dict(failures)
        detail = "; ".join(f"{who}: {why}" for who, why in failures.items())
        super().__init__(f"weight update to version {version} failed: {detail}")

    def __reduce__(self):
        return type(self), (self.version, self.failures)
