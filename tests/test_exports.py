"""Every name a public module exports in ``__all__`` exists, and the package's ``__all__`` is complete."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import recompute

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(recompute.__path__, "recompute.") if not m.name.split(".")[-1].startswith("_")
)


@pytest.mark.parametrize("name", MODULES)
def test_all_names_exist(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names missing attributes: {missing}"


def test_package_exports_its_public_api() -> None:
    for name in recompute.__all__:
        assert getattr(recompute, name) is not None
