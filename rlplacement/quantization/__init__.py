"""Weights the engines serve in another dtype than the trainer trains: block-quantized FP8 (``fp8_block``) and a
folder's scheme read from its ``config.json`` and headers (``scheme``); ``rlplacement.convert.to_fp8`` makes such
a folder from a bf16 one."""
