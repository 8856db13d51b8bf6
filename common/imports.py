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
