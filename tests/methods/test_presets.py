"""Every method package ships a small preset, ``configs/scenarios/small/<package>.yaml``: a
scenario of that package's methods that runs in a couple of minutes on a 2-core machine
(docs/tutorial.md lists them with their times).  Loaded here as ``fcl simulate`` loads a
scenario, without its data."""

from __future__ import annotations

from pathlib import Path

import pytest

import methods
from fclcore.config import load_config
from fclcore.schema import Scenario

SMALL = Path(__file__).resolve().parents[2] / "configs" / "scenarios" / "small"
PACKAGES = sorted({spec.package for spec in methods.REGISTRY.values()})


@pytest.mark.parametrize("package", PACKAGES)
def test_each_method_package_has_a_small_preset_that_loads(package: str) -> None:
    path = SMALL / f"{package}.yaml"
    assert path.is_file(), f"{path} missing: every method package ships a small preset"
    scenario = load_config(Scenario, str(path))
    for name in scenario.compare or [scenario.federation.method]:  # each run, as fcl simulate makes it
        one = load_config(Scenario, str(path), ["compare=[]", f"federation.method={name}"])
        spec, _, _ = methods.resolve(one.run_federation(), str(path))  # its method and options check
        assert spec.package == package, (name, spec.package)


def test_no_preset_without_a_package() -> None:
    assert sorted(p.stem for p in SMALL.glob("*.yaml")) == PACKAGES
