"""The pinned versions of the dependencies (deps/) agree with pyproject.toml:
the locked set satisfies every requirement, and the oldest set is each core
dependency's lower bound, so `REMOTE_TPU_DEPS=oldest` tests what we promise."""

from __future__ import annotations

import pathlib
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _pins(name: str) -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "deps" / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            package, _, version = line.partition("==")
            assert version, f"deps/{name}: {line!r} is not of the form name==version"
            pins[canonicalize_name(package)] = Version(version)
    return pins


def _requirements(*extras: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def test_locked_versions_satisfy_every_requirement():
    pins = _pins("locked.txt")
    for req in _requirements("test"):
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not in deps/locked.txt: run scripts/lock.sh"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"deps/locked.txt pins {req.name}=={pins[name]}, outside {req}"


def test_oldest_versions_are_the_lower_bounds_of_the_core_dependencies():
    pins = _pins("oldest.txt")
    for req in _requirements():
        name = canonicalize_name(req.name)
        floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
        assert floors, f"{req} has no lower bound: give it one (the oldest tested)"
        assert pins.get(name) == max(floors), \
            f"deps/oldest.txt should pin {req.name}=={max(floors)} (the bound of {req})"
