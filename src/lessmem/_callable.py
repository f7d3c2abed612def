"""Modules that are also functions: ``lessmem.compress(model, map)`` and
``lessmem.sensitivity(model, batches)`` call the function of the same name, while
``import lessmem.compress`` / ``from lessmem.sensitivity import ...`` still see the module."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any


def make_module_callable(module_name: str, function: Callable[..., Any]) -> None:
    class _CallableModule(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

    _CallableModule.__call__.__doc__ = function.__doc__
    sys.modules[module_name].__class__ = _CallableModule
