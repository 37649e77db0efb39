"""Do the packages installed on this machine match rlplacement[gpu]? Run on the H200 after the carried
wheels and rlplacement are installed (``--no-deps --target /tmp/site``: benchmarks/gpu/device_setup.sh,
then run_h200.sh's install), under ``source benchmarks/gpu/device_env.sh``:

    python3 benchmarks/gpu/check_gpu_extras.py $OUT/gpu_extras_h200.json \\
        --require vllm ray megatron-core transformer-engine transformer-engine-cu13 transformer-engine-torch

Reads the requirements of the extra (default ``gpu``) from rlplacement's INSTALLED metadata, evaluated
for this interpreter (so ``python_version`` markers pick the megatron-core line), and looks each one up
with importlib.metadata (the first distribution of that name on sys.path, as imports find it). Each row:

- ``ok``: installed, and its version is in the specifier;
- ``MISMATCH``: installed, version outside the specifier (always an error: what runs is not what the
  extra promises, carried or not);
- ``MISSING``: not installed and named in ``--require`` (an error);
- ``not carried``: not installed and not required. Only part of [gpu] is brought to the lent machine
  (e.g. Mooncake's CUDA build, zstandard, matplotlib are not in prepare_carry.sh), so absence alone
  cannot be an error; it is still listed in the table and the JSON, never passed over in silence.

Exit status: 0 when nothing is MISMATCH or MISSING, 1 otherwise (each one named on stderr), 2 when the
check cannot run (rlplacement not installed, ``--require`` naming a distribution the extra does not).
``--require-all`` makes every requirement required: the check for a full ``pip install rlplacement[gpu]``.
Extras of a requirement (``name[x]``) are not followed: the named distribution's version is checked.
Prereleases and local versions (``+cu130``) count as their version (``0.26.1.dev0`` is in ``<0.27``).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import sys
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pragma: no cover - every stack with vLLM or transformers has it
    raise SystemExit("check_gpu_extras.py needs `packaging` (a dependency of transformers and vLLM)")


class CannotCheck(Exception):
    """The check cannot run at all (exit status 2)."""


def extra_requirements(extra: str) -> list[Requirement]:
    """The requirements `pip install rlplacement[extra]` adds on this interpreter (not the base ones)."""
    try:
        lines = md.requires("rlplacement") or []
        provided = md.metadata("rlplacement").get_all("Provides-Extra") or []
    except md.PackageNotFoundError:
        raise CannotCheck("rlplacement is not installed (its metadata is what this checks): install it with "
                         "`python3 -m pip install --no-deps --no-build-isolation --no-index --target /tmp/site .` "
                         "as benchmarks/gpu/run_h200.sh does, with /tmp/site on PYTHONPATH") from None
    if extra not in provided:
        raise CannotCheck(f"rlplacement {md.version('rlplacement')} has no extra [{extra}] (it has: {', '.join(provided)})")
    env = default_environment()
    out = []
    for line in lines:
        req = Requirement(line)
        if req.marker is not None and req.marker.evaluate({**env, "extra": extra}) \
                and not req.marker.evaluate({**env, "extra": ""}):
            out.append(req)
    return out


def check(reqs: list[Requirement], required: set[str]) -> list[dict]:
    rows = []
    for req in reqs:
        name = canonicalize_name(req.name)
        row = {"name": req.name, "requirement": str(req), "specifier": str(req.specifier) or "(any)",
               "required": name in required, "installed": None, "location": None}
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            row["status"] = "MISSING" if row["required"] else "not carried"
        else:
            row["installed"] = dist.version
            row["location"] = str(dist.locate_file(""))
            row["status"] = "ok" if req.specifier.contains(dist.version, prereleases=True) else "MISMATCH"
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    cols = [("status", "status"), ("name", "distribution"), ("specifier", "wants"), ("installed", "installed"),
            ("required", "required"), ("location", "from")]
    cells = [[h for _, h in cols]] + [["-" if r[k] is None else ("yes" if r[k] is True else "" if r[k] is False else
                                       str(r[k])) for k, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(len(cols))).rstrip() for c in cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="where to write the JSON report")
    parser.add_argument("--extra", default="gpu", help="which extra of rlplacement to check (default gpu)")
    parser.add_argument("--require", nargs="*", default=[], metavar="NAME",
                        help="distributions that must be installed (others may be 'not carried')")
    parser.add_argument("--require-all", action="store_true", help="every requirement of the extra must be installed")
    args = parser.parse_args(argv)

    try:
        reqs = extra_requirements(args.extra)
    except CannotCheck as e:
        print(e, file=sys.stderr)
        return 2
    names = {canonicalize_name(r.name) for r in reqs}
    required = names if args.require_all else {canonicalize_name(n) for n in args.require}
    unknown = sorted(required - names)
    if unknown:
        print(f"--require names {', '.join(unknown)}, which rlplacement[{args.extra}] does not require on this "
              f"Python ({', '.join(sorted(names))})", file=sys.stderr)
        return 2

    rows = check(reqs, required)
    errors = [r for r in rows if r["status"] in ("MISMATCH", "MISSING")]
    not_carried = [r["name"] for r in rows if r["status"] == "not carried"]
    report = {
        "extra": args.extra, "rlplacement": md.version("rlplacement"),
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": _version("torch"), "required": sorted(required), "ok": not errors,
        "not_carried": not_carried, "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    print(f"rlplacement[{args.extra}] {report['rlplacement']} on Python {report['python']} (torch {report['torch']})")
    print(table(rows))
    if not_carried:
        print(f"not carried (not installed, not required): {', '.join(not_carried)}")
    for r in errors:
        what = (f"{r['installed']} is installed ({r['location']}), outside {r['specifier']}" if r["status"] == "MISMATCH"
                else "is required (--require) but not installed")
        print(f"{r['status']}: {r['name']} {what}", file=sys.stderr)
    print(f"{'FAIL' if errors else 'OK'}: {len(rows) - len(errors) - len(not_carried)} ok, {len(errors)} wrong, "
          f"{len(not_carried)} not carried; report in {args.out}")
    return 1 if errors else 0


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
