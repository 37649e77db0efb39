"""Who wrote a disk-delta file: a sender's identity and the key that signs what it publishes.

Each :class:`~.sender.DiskDeltaSender` makes its own :class:`SenderIdentity`: the segment it publishes
(``run_id``, ``epoch``), a public id (``sender``) and a 32-byte key from :mod:`secrets`. Receivers get
all four through the endpoint's ``mode_info`` (:class:`~rlplacement.transfer.disk_delta.DiskDeltaInit`),
which travels over the control plane (Ray, vLLM's RPC); the key is never written to the folder.

Invariants: an index or abort marker is taken only when its ``signature`` is the HMAC-SHA256, under
the receiver's key, of its canonical JSON without ``signature`` and ``index_checksum``. So a file
written by anyone who can only write the folder (another run, an edit with the plain checksum
recomputed) is refused, and a pointer or marker of another sender is never taken for this one's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets

from rlplacement.transfer.base import TransferError

SIGNATURE = "signature"
_UNSIGNED = ("signature", "index_checksum")  # the checksum covers the signature, so it is computed after


def canonical(record: dict) -> bytes:
    """The bytes a signature covers: ``record`` without its signature and checksum, keys sorted."""
    body = {k: v for k, v in record.items() if k not in _UNSIGNED}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


@dataclasses.dataclass(frozen=True)
class SenderIdentity:
    run_id: str
    epoch: int
    sender: str
    key: bytes = dataclasses.field(repr=False)

    @classmethod
    def fresh(cls, run_id: str, epoch: int) -> "SenderIdentity":
        """A new sender of segment (``run_id`` or a fresh random one, ``epoch``), with its own key."""
        return cls(run_id or secrets.token_hex(16), int(epoch), secrets.token_hex(8), secrets.token_bytes(32))

    @classmethod
    def from_mode_info(cls, mode_info: dict, where: str) -> "SenderIdentity":
        """The identity a receiver got from the endpoint; refused naming ``where`` when it lacks one."""
        try:
            return cls(str(mode_info["run_id"]), int(mode_info["epoch"]), str(mode_info["sender"]),
                       bytes.fromhex(mode_info["key"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"{where}: the endpoint's mode_info carries no disk-delta sender identity and key "
                                f"({type(exc).__name__}: {exc}); connect with the endpoint the trainer's "
                                f"DiskDeltaSender.listen returned") from exc

    def mode_info(self) -> dict:
        """``TransferEndpoint.mode_info`` (``DiskDeltaInit``'s fields, the key as hex)."""
        return {"run_id": self.run_id, "epoch": self.epoch, "sender": self.sender, "key": self.key.hex()}

    @property
    def segment(self) -> tuple[str, int]:
        return self.run_id, self.epoch

    def describe(self) -> str:
        return f"run {self.run_id} epoch {self.epoch}"

    def stamp(self) -> dict:
        """The fields every file this sender writes carries."""
        return {"run_id": self.run_id, "epoch": self.epoch, "sender": self.sender}

    def owns(self, record: dict | None) -> bool:
        """Whether a pointer or marker says this sender wrote it (its signature aside)."""
        return record is not None and (record.get("run_id"), record.get("epoch"), record.get("sender")) == (
            self.run_id, self.epoch, self.sender)

    def sign(self, record: dict) -> dict:
        """``record`` with this sender's fields and its signature added (in place, and returned)."""
        record.update(self.stamp())
        record[SIGNATURE] = hmac.new(self.key, canonical(record), hashlib.sha256).hexdigest()
        return record

    def verifies(self, record: dict) -> bool:
        """Whether ``record`` was signed with this key (constant-time comparison)."""
        got = record.get(SIGNATURE)
        want = hmac.new(self.key, canonical(record), hashlib.sha256).hexdigest()
        return isinstance(got, str) and hmac.compare_digest(got, want)


def describe_record(record: dict | None) -> str:
    """Whose a pointer or marker says it is, for messages."""
    if record is None:
        return "nothing"
    if "run_id" not in record:
        return "a folder written before runs were recorded"
    return f"run {record.get('run_id')} epoch {record.get('epoch')}"
