"""Bounded waits on Ray actors that say who did not answer.

Every wait on a peer in the library goes through :func:`wait_named`: a peer that died or hangs
turns into an error naming it within ``timeout_s``, never a silent hang (an NCCL peer that
never closes, a stuck engine). After the first failure the others get ``FAILURE_GRACE_S`` to
report their own causes, so the error names the root cause, not only its echoes.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from rlplacement.errors import PeerError

FAILURE_GRACE_S = 5.0


def cause_of(exc: BaseException) -> str:
    """One line: the remote exception's type and last message line, or that the actor died."""
    import ray

    if isinstance(exc, ray.exceptions.RayTaskError):
        inner = exc.cause if getattr(exc, "cause", None) is not None else exc
        text = str(inner).strip().splitlines()
        return f"{type(inner).__name__}: {text[-1] if text else ''}"
    if isinstance(exc, ray.exceptions.ActorDiedError | ray.exceptions.RayActorError):
        return "actor died (process killed or crashed)"
    return f"{type(exc).__name__}: {exc}"


def wait_named(refs: dict[str, Any], timeout_s: float, what: str = "remote call",
               error: Callable[[dict[str, str]], BaseException] | None = None) -> dict[str, Any]:
    """``ray.get`` every ref (keyed by who runs it) within ``timeout_s``; results by the same keys.

    Raises ``error(failures)`` (default :class:`PeerError`) naming each party that failed or did
    not answer; failures are ordered engines first, the trainer last (its error is usually the
    echo of an engine's).
    """
    import ray

    deadline = time.monotonic() + timeout_s
    pending = {ref: who for who, ref in refs.items()}
    results: dict[str, Any] = {}
    failures: dict[str, str] = {}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        done, _ = ray.wait(list(pending), num_returns=1, timeout=left)
        for ref in done:
            who = pending.pop(ref)
            try:
                results[who] = ray.get(ref, timeout=0)
            except Exception as exc:  # noqa: BLE001 - every cause is reported
                failures[who] = cause_of(exc)
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    for who in pending.values():
        failures[who] = f"no answer within {timeout_s:.0f}s" if not failures else "did not finish after the failure"
    if failures:
        ordered = dict(sorted(failures.items(), key=lambda kv: kv[0].startswith("trainer")))
        raise error(ordered) if error is not None else PeerError(what, ordered)
    return results


def get_all(refs: list, timeout_s: float, what: str, names: list[str] | None = None) -> list:
    """``wait_named`` for a list of refs (named ``names`` or ``"#i"``); results in order."""
    names = names or [f"#{i}" for i in range(len(refs))]
    results = wait_named(dict(zip(names, refs)), timeout_s, what)
    return [results[n] for n in names]
