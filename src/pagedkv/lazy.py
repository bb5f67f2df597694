"""Lazy package attributes (PEP 562): a package re-exports names without importing the modules
that hold them until one is used, so importing one light module of a package (the router reads
the server's request models) does not pay for its heavy siblings (torch)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` resolving each name in ``homes`` (name ->
    module) on first use and caching it in the package."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
