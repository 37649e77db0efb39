"""A framework's per-backend options (verl's ``engine_kwargs.<backend>``, Miles' args) turned
into our validated :class:`~rlplacement.config.TransferConfig`.

The keys are our flags' names with underscores (``update_weight_disk_dir`` for
``--update-weight-disk-dir``), so every option is defined once, in ``rlplacement.args``, and
validated by the same code as on our own command line. Unknown keys are refused, listing the
accepted ones: a typo must not fall back to a default silently.
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping

from rlplacement.args import transfer_from_args
from rlplacement.config import TransferConfig
from rlplacement.errors import ConfigError
from rlplacement.transfer import registry
from rlplacement.transfer.spec import flag_dest



def transfer_option_keys() -> tuple[str, ...]:
    """Our transfer flags a framework may set per backend: the equality check and every mode's option
    flags; the mode and the bucket size come from the framework's own settings (verl: the backend name
    and update_weights_bucket_megabytes)."""
    return ("check_weight_update_equal",) + tuple(flag_dest(f) for s in registry.specs().values()
                                                  for f in s.option_fields)


def transfer_config(mode: str, bucket_bytes: int, options: Mapping[str, Any], *, where: str,
                    owned_elsewhere: Mapping[str, str] = {}) -> TransferConfig:
    """Validate ``options`` (keys from :func:`transfer_option_keys`) for split-layout ``mode``.

    ``where`` names the options' place in the framework's config for error messages;
    ``owned_elsewhere`` maps keys the framework sets itself to the setting to use instead.
    """
    keys = transfer_option_keys()
    for key in options:
        if key in owned_elsewhere:
            raise ConfigError(f"{where}.{key}: set {owned_elsewhere[key]} instead (the framework owns it).")
        if key not in keys:
            raise ConfigError(f"{where}.{key} is not an rlplacement option: use one of "
                              f"{', '.join(keys)} (our flags' names with underscores).")
    # flags missing from the namespace take their defaults in transfer_from_args
    args = argparse.Namespace(**{**options, "update_weight_transfer_mode": mode,
                                 "update_weight_buffer_size": bucket_bytes, "colocate": False})
    try:
        return transfer_from_args(args)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc} (the flag --x-y is the key x_y here)") from None
