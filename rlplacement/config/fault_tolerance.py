"""What the job repairs by itself under ``--use-fault-tolerance``."""

from __future__ import annotations

import dataclasses

from rlplacement.errors import ConfigError


FT_COMPONENTS = ("rollout", "train")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultToleranceConfig:
    """What the job repairs by itself (``--use-fault-tolerance``, Miles' flags; ``rlplacement.job.fault_tolerance``):
    ``rollout``: engines health-checked between steps, a dead or hung one killed, restarted in its own
    placement bundle and brought to the trainer's version before it serves; ``train``: a dead trainer rank
    takes the trainer down and the job restarts it from the last ``--save``, keeping the engines."""

    enabled: bool = False
    components: tuple[str, ...] = ("rollout",)
    """Which sides are repaired (``--ft-components``)."""
    health_check_interval_s: float = 30.0
    """At most one health check per this many seconds, between steps (``--rollout-health-check-interval``)."""
    health_check_timeout_s: float = 30.0
    """An engine that does not answer a health check within this is hung: killed and restarted
    (``--rollout-health-check-timeout``)."""
    health_check_first_wait_s: float = 0.0
    """No health check before this many seconds after start: first-use compilation may stall an engine
    (``--rollout-health-check-first-wait``)."""
    max_restarts: int = 8
    """Repairs of one kind (engines, the trainer) the job makes within any :attr:`restart_window_s` before it
    gives up with one error: a fault that comes back at every restart is not one to repair, while a
    week-long run meets a fault now and then and goes on."""
    restart_window_s: float = 3600.0
    """The window :attr:`max_restarts` counts in, in seconds."""

    def __post_init__(self) -> None:
        unknown = [c for c in self.components if c not in FT_COMPONENTS]
        if unknown or not self.components:
            raise ConfigError(f"--ft-components {','.join(self.components)!r}: use a comma-separated subset of "
                              f"{','.join(FT_COMPONENTS)}")
        for name, value in (("--rollout-health-check-interval", self.health_check_interval_s),
                            ("--rollout-health-check-timeout", self.health_check_timeout_s)):
            if not value > 0:
                raise ConfigError(f"{name} {value}: must be a positive number of seconds")
        if self.health_check_first_wait_s < 0:
            raise ConfigError(f"--rollout-health-check-first-wait {self.health_check_first_wait_s}: must be 0 or more "
                              f"seconds")

    def repairs(self, component: str) -> bool:
        return self.enabled and component in self.components
