"""The dummy engine kind's class: vLLM's, taking the dummy's own keyword and leaving a mark of the process
that built it."""

import os
from pathlib import Path

from rlplacement.engines.vllm.vllm_engine import VllmRolloutEngine
from tests.dummy_engine import MARKS_ENV


class DummyRolloutEngine(VllmRolloutEngine):
    def __init__(self, model_dir: str, *, dummy_label: str, **kwargs):
        marks = os.environ.get(MARKS_ENV)
        if marks:
            Path(marks).mkdir(parents=True, exist_ok=True)
            (Path(marks) / str(os.getpid())).write_text(dummy_label)
        super().__init__(model_dir, **kwargs)
