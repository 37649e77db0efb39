"""Keep the trainer libraries' notices to their own developers out of a quiet log.

megatron-core warns at every model build that Apex is missing (it falls back to torch's norms, which is
what runs here on purpose) and that a config default of its own is deprecated; TransformerEngine and
Apex raise FutureWarnings about their next releases. None of them changes a result; together they were
20 of a megatron run's 23 lines. Without ``--verbose`` (``ENV`` set by the job) these, and only these,
are dropped, by message or by the module that raises them; every other warning still shows.
"""

from __future__ import annotations

import os
import warnings

ENV = "RLPLACEMENT_QUIET_TRAINER_NOTICES"
# (message, category): megatron's fallbacks and config deprecations; torch's notice, raised where megatron's
# checkpoints load through ShardedTensor, that ShardedTensor gives way to DTensor
MESSAGES = ((r"(Transformer Engine and )?Apex (is|are) not installed", UserWarning),
            (r"full scope is deprecated", UserWarning),
            (r"Please use DTensor instead", FutureWarning))
MODULES = r"(transformer_engine|apex|megatron)(\..*)?$"


def quiet_trainer_notices() -> None:
    """Install the filters in this process; does nothing unless the job asked for a quiet log."""
    if os.environ.get(ENV) != "1":
        return
    for message, category in MESSAGES:
        warnings.filterwarnings("ignore", message=message, category=category)
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=MODULES)
