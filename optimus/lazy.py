"""Names of a package that load on first use (PEP 562's module `__getattr__`).

The `optimus` command imports a few light names (errors) from packages whose other modules load
torch; the operator's subcommands should start without it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_names(package: str, where: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` for `package`: name -> the submodule that defines it. A name must
    not be a submodule's own name (importing the submodule would bind that name to it)."""
    def load(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        setattr(sys.modules[package], name, value)  # found directly from now on
        return value
    return load
