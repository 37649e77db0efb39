"""Check or apply rlplacement's patches to an installed framework.

    python patches/apply.py verl --check     # is each patch applied, applicable, or refused?
    python patches/apply.py verl --apply     # apply what is not applied yet (idempotent)
    python patches/apply.py verl --apply --site DIR   # the package folder's parent (default: where
                                                     # it is installed for this Python)

A patch is refused, changing nothing, when the installed version is not the one it was made for or
when its target lines are not there exactly as expected (a file already edited by hand). Patches
are unified diffs against the named version; every hunk of a file must apply, or none is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Patch:
    package: str
    version: str
    diff: str  # file name under patches/
    why: str


PATCHES = {
    "verl": [Patch("verl", "0.9.1", "verl-0.9.1-pools-on-layout-nodes.diff",
                   "pin verl's trainer and rollout placement groups to the nodes of rlplacement's layout")],
}


class PatchError(Exception):
    """A patch that must not be applied here; the message says why and what to do."""


@dataclasses.dataclass
class Hunk:
    old: list[str]
    new: list[str]


def parse_diff(text: str) -> dict[str, list[Hunk]]:
    """Unified diff -> {path relative to the site folder: hunks}."""
    files: dict[str, list[Hunk]] = {}
    current: list[Hunk] | None = None
    for line in text.splitlines(keepends=True):
        if line.startswith("--- "):
            continue
        if line.startswith("+++ "):
            path = line[4:].strip()
            current = files.setdefault(path[2:] if path.startswith("b/") else path, [])
        elif line.startswith("@@"):
            current.append(Hunk([], []))
        elif current and line[:1] in (" ", "-", "+"):
            hunk = current[-1]
            if line[0] in " -":
                hunk.old.append(line[1:])
            if line[0] in " +":
                hunk.new.append(line[1:])
        elif current and line in ("\n", ""):  # an empty context line some editors strip
            current[-1].old.append("\n")
            current[-1].new.append("\n")
    return files


def installed_version(site: Path, package: str) -> str | None:
    for metadata in site.glob(f"{package}-*.dist-info/METADATA"):
        match = re.search(r"^Version: (\S+)", metadata.read_text(), re.M)
        if match:
            return match.group(1)
    return None


def _state(text: str, hunks: list[Hunk]) -> str:
    """'applied', 'applicable' or 'conflict' for one file's hunks against its text."""
    if all(text.count("".join(h.new)) == 1 for h in hunks):
        return "applied"
    if all(text.count("".join(h.old)) == 1 for h in hunks):
        return "applicable"
    return "conflict"


def check(patch: Patch, site: Path) -> dict[Path, tuple[str, list[Hunk]]]:
    """Each target file's state and hunks; raises PatchError for a version this patch was not made for."""
    version = installed_version(site, patch.package)
    if version != patch.version:
        raise PatchError(f"{patch.diff} is made for {patch.package} {patch.version}, but {site} has "
                         f"{patch.package} {version or '(no version found)'}: install {patch.package}=={patch.version} "
                         f"or use a patch made for {version}")
    states = {}
    for rel, hunks in parse_diff((HERE / patch.diff).read_text()).items():
        target = site / rel
        if not target.is_file():
            raise PatchError(f"{patch.diff}: {target} does not exist")
        states[target] = (_state(target.read_text(), hunks), hunks)
    return states


def apply(patch: Patch, site: Path) -> list[str]:
    states = check(patch, site)
    conflicts = [str(p) for p, (s, _) in states.items() if s == "conflict"]
    if conflicts:
        raise PatchError(f"{patch.diff}: the lines it changes differ in {', '.join(conflicts)} (edited by hand, or "
                         f"another patch): restore the file from {patch.package}=={patch.version} and apply again")
    report = []
    for target, (state, hunks) in states.items():
        if state == "applicable":
            text = target.read_text()
            for hunk in hunks:
                text = text.replace("".join(hunk.old), "".join(hunk.new), 1)
            target.write_text(text)
        report.append(f"{target}: {'applied now' if state == 'applicable' else 'already applied'}")
    return report


def default_site(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PatchError(f"{package} is not installed for {sys.executable}: pass --site DIR")
    return Path(list(spec.submodule_search_locations)[0]).parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", choices=sorted(PATCHES))
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--check", action="store_true")
    action.add_argument("--apply", action="store_true")
    parser.add_argument("--site", type=Path, default=None, help="folder holding the package folder")
    args = parser.parse_args(argv)
    try:
        site = args.site or default_site(args.package)
        for patch in PATCHES[args.package]:
            if args.apply:
                print("\n".join(apply(patch, site)))
            else:
                for target, (state, _) in check(patch, site).items():
                    print(f"{patch.diff}: {target}: {state}")
                    if state == "conflict":
                        return 1
    except PatchError as exc:
        print(f"patches/apply.py: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
