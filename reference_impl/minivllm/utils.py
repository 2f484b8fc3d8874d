"""Small helpers shared across the engine."""

from __future__ import annotations

import importlib


def resolve_obj_by_qualname(qualname: str, option: str) -> type:
    """"package.module.Name" -> the object, for options that take a class by name."""
    module_name, _, attr = qualname.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(
            f"{option}={qualname!r} names no importable class: give a class or "
            f"'package.module.ClassName' ({e})"
        ) from e


def resolve_class(value: str | type, option: str) -> type:
    """An option given as a class or by its qualified name -> the class."""
    cls = resolve_obj_by_qualname(value, option) if isinstance(value, str) else value
    if not isinstance(cls, type):
        raise ValueError(f"{option} must be a class or 'package.module.ClassName', got {value!r}")
    return cls
