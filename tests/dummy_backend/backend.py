"""The dummy backend's class: fsdp's, named ``dummy``, leaving a mark of the process that built it."""

import os
from pathlib import Path

from rlplacement.backends.fsdp.backend import FSDPBackend
from tests.dummy_backend import MARKS_ENV


class DummyBackend(FSDPBackend):
    name = "dummy"

    @classmethod
    def from_config(cls, cfg, *args, **kwargs):
        marks = os.environ.get(MARKS_ENV)
        if marks:
            Path(marks).mkdir(parents=True, exist_ok=True)
            (Path(marks) / str(os.getpid())).write_text(cfg.name)
        return super().from_config(cfg, *args, **kwargs)
