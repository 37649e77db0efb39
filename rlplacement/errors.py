"""Every error the library raises on purpose, in one leaf module (it imports nothing), so any layer,
process or framework plug-in can raise or catch them without importing a transfer mode, Ray or torch.

Three families:
- :class:`ConfigError`, :class:`CliError`: bad input, found before any work starts; the message names
  the flag (or file) and what to change. The CLI prints them without a traceback, exit status 2.
- :class:`PeerError`: one shape for every failure gathered from other processes (trainer ranks,
  engines): ``what`` failed and ``failures``, who -> why, engines first. :class:`WeightUpdateError` is
  the same shape for a weight update.
- :class:`TransferError` and its kinds: a weight update that did not complete; the receiver keeps
  its previous version.

Every error here survives pickling (those with fields of their own define ``__reduce__``): they
cross Ray and vLLM's engine-core RPC, and one that cannot be rebuilt reaches the user as "Failed to
deserialize exception" with the tensor's name lost.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A flag combination that cannot run; the message names the flag and what to change."""


class ContextLengthError(ConfigError):
    """A generate request whose prompt plus max tokens exceeds the engines' context; names both."""


class CliError(Exception):
    """A user-facing error of a subcommand (bad subcommand-only input)."""


class PeerError(RuntimeError):
    """One or more peers failed or did not answer in time; ``failures`` maps each to why."""

    def __init__(self, what: str, failures: dict[str, str]):
        self.what, self.failures = what, dict(failures)
        detail = "; ".join(f"{who}: {why}" for who, why in self.failures.items())
        super().__init__(f"{what} failed: {detail}")

    def __reduce__(self):  # rebuilt from its fields on the other side of Ray
        return type(self), (self.what, self.failures)


class EngineStuckError(TimeoutError):
    """An engine that cannot serve until it is restarted: a call into it (a worker call, a generation step)
    overran its bound and still holds it. ``--use-fault-tolerance`` restarts an engine that answers with it."""


class GpuMemoryError(RuntimeError):
    """Out of GPU memory where a colocated hand-off flag would have freed it; names the flag."""


class TransferError(RuntimeError):
    """A weight update that did not complete; the receiver keeps its previous version."""


class UpdateAborted(TransferError):
    """The trainer stopped an update on purpose (its weight source failed) and told the engines."""


class UpdateRefused(TransferError):
    """Some receivers refused an update that ran to its end (the others serve it); the group is in step."""


class WeightsUnavailableError(TransferError):
    """An engine asked to generate while it holds no whole version: its weights were discarded (a
    level-2 sleep) or partly written (a failed load) and no full update has landed since."""


class WeightMismatchError(TransferError):
    """--check-weight-update-equal found a tensor whose checksum differs between the two sides."""

    def __init__(self, name: str, expected: str, got: str, where: str = ""):
        self.name, self.expected, self.got = name, expected, got
        self.where = where
        super().__init__(f"weight mismatch{(' on ' + where) if where else ''}: tensor {name!r} has "
                         f"checksum {got} but the trainer sent {expected}")

    def __reduce__(self):
        return type(self), (self.name, self.expected, self.got, self.where)


class WeightUpdateError(PeerError, TransferError):
    """An update across trainer + engines failed: a :class:`PeerError` whose ``what`` is the version."""

    def __init__(self, version: int, failures: dict[str, str]):
        self.version = version
        super().__init__(f"weight update to version {version}", failures)

    def __reduce__(self):
        return type(self), (self.version, self.failures)


class ReconcileError(TransferError):
    """After a failed update, the engines could not be brought to the trainer's weights: the job cannot go
    on serving one version everywhere. Names what failed first and why the repair failed."""

    def __init__(self, why_stale: str, repair: BaseException):
        self.why_stale, self.repair = why_stale, repair
        super().__init__(f"{why_stale}; bringing every engine to the trainer's weights failed too: "
                         f"{type(repair).__name__}: {repair}. An engine that cannot take an update must be "
                         f"replaced (--use-fault-tolerance restarts dead engines) or the run resumed with --load")

    def __reduce__(self):
        return type(self), (self.why_stale, self.repair)


class DeltaDecodeError(ValueError):
    """A disk-delta payload that does not decode into the tensor its index entry describes."""
