"""requirements.txt's tested ranges: every dependency with a range has both bounds, constraints-lowest.txt pins
exactly the lower ones, and the installed versions lie inside the ranges (a run on untested versions fails here)."""
import os
from importlib.metadata import PackageNotFoundError, version

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST_MOVING = ("transformers", "peft", "tokenizers", "swanlab")


def read_lines(name):
    with open(os.path.join(ROOT, name)) as f:
        return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]


REQUIREMENTS = {r.name: r for r in map(Requirement, read_lines("requirements.txt"))}
LOWEST = {r.name: r for r in map(Requirement, read_lines("constraints-lowest.txt"))}


def bounds(requirement):
    """(lower, upper) of a `>=a,<=b` range."""
    spec = {s.operator: Version(s.version) for s in requirement.specifier}
    return spec.get(">="), spec.get("<=")


@pytest.mark.parametrize("name", FAST_MOVING)
def test_fast_moving_dependencies_have_a_tested_range(name):
    lower, upper = bounds(REQUIREMENTS[name])
    assert lower is not None and upper is not None and lower <= upper


def test_constraints_pin_exactly_the_lower_bounds():
    ranged = {name for name, r in REQUIREMENTS.items() if bounds(r)[0] is not None}
    assert set(LOWEST) == ranged
    for name, pin in LOWEST.items():
        (spec,) = pin.specifier
        assert spec.operator == "==" and Version(spec.version) == bounds(REQUIREMENTS[name])[0], name


@pytest.mark.parametrize("name", sorted(REQUIREMENTS))
def test_installed_version_is_inside_the_tested_range(name):
    try:
        installed = version(name)
    except PackageNotFoundError:
        pytest.fail(f"{name} is in requirements.txt but not installed")
    assert REQUIREMENTS[name].specifier.contains(installed, prereleases=True), \
        f"{name} {installed} is outside the tested range {REQUIREMENTS[name].specifier}"
