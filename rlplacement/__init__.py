"""rlplacement: placement, weight transfer and trainer backends for RL post-training loops.

Heavy optional parts (ray, vllm, megatron, mooncake) are imported only where used.
"""

from rlplacement.args import Config, ConfigError, add_arguments, config_from_args

__all__ = ["Config", "ConfigError", "add_arguments", "config_from_args"]
__version__ = "0.1.0"
