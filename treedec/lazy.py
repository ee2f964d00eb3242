"""Lazy public names for a package's ``__init__``: each imported from its module on first use (so importing the
package imports none of them), then kept in the package's namespace.

    __getattr__, __dir__ = lazy_names(globals(), {"LLM": "treedec.llm", ...})
"""
from __future__ import annotations

import importlib   # (nothing else: ``import treedec`` imports no module a working directory could shadow)


def lazy_names(namespace: dict, names: dict[str, str]) -> tuple:
    """The module ``__getattr__`` and ``__dir__`` (PEP 562) of the package whose globals are ``namespace``: ``names``
    maps each public name to the module it is defined in. Returns ``(__getattr__, __dir__)``."""
    package = namespace["__name__"]

    def __getattr__(name: str):
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
            namespace[name] = value   # imported once
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted([*namespace, *names])

    return __getattr__, __dir__
