"""How the driver reaches the actors for one weight update: a Ray Compiled Graph where it pays, plain
actor calls otherwise, and the fallback from one to the other.

A compiled graph saves ~2 ms of Ray per update (``runtime.update_graph``), which shows only where an
update takes milliseconds: a trainer on a GPU. Compiling costs ~1 s, once per set of actors, so the
graph is built on the first update and rebuilt only after it broke or an actor was replaced. If it
cannot be compiled, the same calls go plainly from then on (said once, through ``logging``).
"""

from __future__ import annotations

import logging
from typing import Sequence

from rlplacement.runtime import transfer_driver as driver
from rlplacement.transfer.base import UpdateResult

log = logging.getLogger(__name__)


class UpdateDispatch:
    """Runs :func:`transfer_driver.run_update` for the current senders and engines, compiled or plain."""

    def __init__(self, *, compiled: bool, timeout_s: float):
        self.compiled = compiled
        """Whether updates go through a compiled graph (False after a failed compile)."""
        self.timeout_s = timeout_s
        self._graph = None

    def run(self, trainer, engines: Sequence, version: int, *, check_equal: bool,
            whole_each: bool = False) -> UpdateResult:
        return driver.run_update(trainer, engines, version, timeout_s=self.timeout_s, check_equal=check_equal,
                                 graph=self._graph_for(trainer, engines), whole_each=whole_each)

    def _graph_for(self, trainer, engines: Sequence):
        """The compiled graph of these actors (built on first use, and again after it broke or an actor
        was replaced), or None for plain calls."""
        if not self.compiled:
            return None
        graph = self._graph
        if graph is None or not graph.serves(trainer, engines):
            from rlplacement.runtime.update_graph import CompiledUpdate

            self.close()
            graph = None
            try:
                self._graph = graph = CompiledUpdate(trainer, engines, timeout_s=self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - the same calls go plainly, ~2 ms slower per update
                self.compiled = False
                log.warning("updates go through plain Ray calls: compiling the update graph failed (%s: %s)",
                            type(exc).__name__, exc)
        return graph

    def close(self) -> None:
        """Tear the graph down: before its actors go (a graph's loops run on them) or join another graph."""
        graph, self._graph = self._graph, None
        if graph is not None:
            graph.close()
