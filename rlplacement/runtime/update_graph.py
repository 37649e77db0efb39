"""Weight updates dispatched through a Ray Compiled Graph instead of plain actor calls.

A plain Ray actor call costs about a millisecond to reach the actor and most of one to come back, a
large share of a colocated update of a small model (benchmarks/README.md has the measured timeline). A
compiled graph of the same calls (the trainer's
``transfer_send`` and every engine's ``update_weights``, all given the version) passes arguments and
results through shared-memory channels set up once, in well under 0.1 ms. Its tasks run on a
background thread of each actor, which is why both actor classes take turns between their methods
(``runtime.one_at_a_time``).

Failure contract, as for plain calls (``transfer_driver.run_update``): :class:`WeightUpdateError`
naming every party that failed or did not answer within the timeout, engines first. A task's own
exception leaves the graph usable; after a timeout or a lost actor the graph is torn down (in the
background: teardown waits for the actors' loops) and :attr:`broken` says why, so the caller builds
a new one for the next update. :meth:`close` waits for a teardown at most the job's timeout.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

from rlplacement.runtime.waits import cause_of
from rlplacement.transfer.base import WeightUpdateError

PROBE_TIMEOUT_S = 10.0  # asking an actor that did not answer what it is doing (a plain call, no turn needed)


class CompiledUpdate:
    """``run(version)`` == plain ``transfer_send`` on the trainer and ``update_weights`` on every engine."""

    def __init__(self, trainer, engines: Sequence, *, timeout_s: float):
        from ray.dag import InputNode, MultiOutputNode

        from rlplacement.runtime.transfer_driver import sender_list, sender_names

        senders = sender_list(trainer)
        self.timeout_s = float(timeout_s)
        self.actors = (*senders, *engines)
        self.names = [*sender_names(len(senders)), *(f"engine {i}" for i in range(len(engines)))]
        with InputNode() as version:
            outputs = [*(s.transfer_send.bind(version) for s in senders),
                       *(e.update_weights.bind(version) for e in engines)]
        self._graph = MultiOutputNode(outputs).experimental_compile(_submit_timeout=timeout_s)
        self._teardown: threading.Thread | None = None
        self.broken: str | None = None

    def serves(self, trainer, engines: Sequence) -> bool:
        """Whether this graph was built for exactly these actor handles and still works."""
        from rlplacement.runtime.transfer_driver import sender_list

        actors = (*sender_list(trainer), *engines)
        return self.broken is None and len(self.actors) == len(actors) and all(
            a is b for a, b in zip(self.actors, actors))

    def run(self, version: int, timeout_s: float) -> dict[str, Any]:
        """Results by name (``"trainer"``, ``"engine i"``); raises WeightUpdateError naming the failures."""
        import ray
        from ray.exceptions import RayChannelError, RayChannelTimeoutError

        if self.broken is not None:
            raise WeightUpdateError(version, {"update graph": f"torn down earlier ({self.broken})"})
        deadline = time.monotonic() + timeout_s
        try:
            refs = self._graph.execute(int(version))
        except Exception as exc:  # noqa: BLE001 - the graph could not take the update: none of it ran
            self._tear_down(f"execute failed: {cause_of(exc)}")
            raise WeightUpdateError(version, {"update graph": cause_of(exc)}) from exc
        results: dict[str, Any] = {}
        failures: dict[str, str] = {}
        try:
            for who, ref in zip(self.names, refs):  # the first get reads every output of this execution
                try:
                    results[who] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                except RayChannelError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the task raised: every cause is reported
                    failures[who] = cause_of(exc)
        except RayChannelError as exc:
            timed_out = isinstance(exc, RayChannelTimeoutError)
            failures = self._who_did_not_answer(timeout_s if timed_out else None)
            self._tear_down(f"no answer within {timeout_s:.0f}s" if timed_out else cause_of(exc))
        if failures:
            ordered = dict(sorted(failures.items(), key=lambda kv: kv[0].startswith("trainer")))
            raise WeightUpdateError(version, ordered)
        return results

    def _who_did_not_answer(self, timeout_s: float | None) -> dict[str, str]:
        """After a timeout (``timeout_s``) or a broken channel (None): every outcome of an execution
        arrives at once, so each actor is asked apart, with plain bounded calls, what it is doing."""
        import ray

        asked = {who: actor.current_call.remote() for who, actor in zip(self.names, self.actors)}
        out = {}
        for who, ref in asked.items():
            try:
                call = ray.get(ref, timeout=PROBE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - dead, or not answering even a plain call
                out[who] = cause_of(exc)
                continue
            if call and timeout_s is not None:
                out[who] = f"no answer within {timeout_s:.0f}s (still in {call})"
        if not out:
            out["update graph"] = (f"no answer within {timeout_s:.0f}s, though every actor is idle" if timeout_s
                                   is not None else "a channel broke, though every actor answers")
        return out

    def _tear_down(self, why: str) -> None:
        self.broken = why
        graph, self._graph = self._graph, None
        if graph is not None:
            self._teardown = threading.Thread(target=_quietly_tear_down, args=(graph,), daemon=True,
                                              name="rlplacement-update-graph-teardown")
            self._teardown.start()

    def close(self) -> None:
        """Tear the graph down now, or finish a teardown begun after a failure: before its actors are
        killed or join another graph (an actor runs one). Bounded by the job's ``timeout_s``: Ray's own
        teardown waits for every actor's loop to end, without a bound once its first wait ran out;
        TimeoutError (naming the actors) when it has not ended in time (the teardown goes on in the
        background)."""
        graph, self._graph = self._graph, None
        self.broken = self.broken or "closed"
        if graph is not None:
            self._teardown = threading.Thread(target=_quietly_tear_down, args=(graph,), daemon=True,
                                              name="rlplacement-update-graph-teardown")
            self._teardown.start()
        if self._teardown is not None:
            self._teardown.join(self.timeout_s)
            if self._teardown.is_alive():
                raise TimeoutError(f"the compiled update graph's teardown did not end within {self.timeout_s:g} s: "
                                   f"the update loop of one of {', '.join(self.names)} did not stop (an actor stuck "
                                   f"in an update); the bound is the job's timeout_s (RLJob.start(timeout_s=...))")
            self._teardown = None


def _quietly_tear_down(graph) -> None:
    try:
        graph.teardown()
    except Exception:  # noqa: BLE001 - closing must not hide the error that led here
        pass
