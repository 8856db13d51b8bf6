"""Loading a user's model or dataset factory from ``package.module:function``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_callable(path: str, what: str, builtins: dict[str, Any]) -> Callable[..., Any]:
    if ":" not in path:
        raise ValueError(
            f"unknown {what} {path!r}: use a built-in ({', '.join(sorted(builtins))}) "
            f"or an import path like mypackage.models:build"
        )
    module_name, attr = path.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {what} module {module_name!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{module_name} has no callable {attr!r} for the {what}")
    return fn


def import_path_of(fn: Any, what: str) -> str:
    """``package.module:function`` for a callable another process can import (worker daemons
    load the job's parts by import path); ValueError saying why when it cannot."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    module_name = getattr(fn, "__module__", None)
    if not callable(fn) or not name or not module_name:
        raise ValueError(f"the {what} {fn!r} is not a function a worker process can import")
    if "<lambda>" in name or "<locals>" in name or "." in name:
        raise ValueError(
            f"the {what} {module_name}.{name} cannot be imported by another process (a lambda, "
            "a nested function or a method): define it at the top level of a module"
        )
    if module_name == "__main__":
        raise ValueError(
            f"the {what} {name} is defined in __main__ (the script being run), which the worker "
            "processes cannot import: move it into a module next to the script and import it "
            "from there"
        )
    path = f"{module_name}:{name}"
    try:
        found = import_callable(path, what, {})
    except ValueError as e:
        raise ValueError(f"the {what} {path} cannot be imported again: {e}") from None
    if found is not fn:
        raise ValueError(f"importing {path} gives another object than the {what} given")
    return path
