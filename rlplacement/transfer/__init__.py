"""Weight transfer trainer -> rollout engines: one protocol (``base``), shared bucketing
(``bucket``), one module per mode, a registry (``registry``) and the driver-side update
(``driver``). Importing this package imports nothing heavy; each module imports torch/ray
where it needs them.
"""
