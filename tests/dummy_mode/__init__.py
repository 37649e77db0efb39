"""A transfer mode defined only here, in a test package: the broadcast wire under another name, with one
option of its own. Registering it (:func:`register`) is all it takes for the flags, ``plan --emit``,
the advisor and ``bench`` to serve it (tests/test_mode_spec.py)."""

import dataclasses

from rlplacement.errors import ConfigError
from rlplacement.transfer import registry
from rlplacement.transfer.spec import LINK, SPLIT, BenchSpec, ModeSpec, OptionsBase, flag_field


@dataclasses.dataclass(frozen=True)
class DummyOptions(OptionsBase):
    pigeons: int = flag_field("--dummy-pigeons", 2, type=int, help="dummy mode: pigeons per bucket (1 or more).")

    def __post_init__(self) -> None:
        if self.pigeons < 1:
            raise ConfigError(f"--dummy-pigeons {self.pigeons}: use 1 or more.")


SPEC = ModeSpec(
    name="dummy", sender="tests.dummy_mode.mode:DummySender", receiver="tests.dummy_mode.mode:DummyReceiver",
    summary="the broadcast wire under a test's name", options=DummyOptions, layouts=frozenset({SPLIT}),
    advisor_path=LINK, advisor_efficiency=0.9, bench=BenchSpec(ceiling="broadcast"),
    verl_backend="rlplacement_dummy", miles_factory="dummy")


def register() -> None:
    registry.register_mode(SPEC)


def unregister() -> None:
    registry.unregister_mode(SPEC.name)
