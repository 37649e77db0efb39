"""HF folder <-> Megatron torch_dist checkpoint, once (``rlplacement convert`` / ``export-hf``)."""
