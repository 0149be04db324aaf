"""The model zoo: `build_<name>(input_shape, num_classes, **hp) -> keras.Model`, registered by name.

Models are returned uncompiled: the optimizer, loss and distribution are chosen in one place (the
trainer), never inside a model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Builder = Callable[..., Any]
_REGISTRY: dict[str, Builder] = {}


def register(name: str) -> Callable[[Builder], Builder]:
    """Decorator: register a builder under `name` (a second builder for a name is an error)."""

    def add(builder: Builder) -> Builder:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered")
        _REGISTRY[name] = builder
        return builder

    return add


def names() -> list[str]:
    """Registered model names, sorted."""
    return sorted(_REGISTRY)


def build(name: str, input_shape: tuple[int, ...], num_classes: int, **hp: Any) -> Any:
    """Build a registered model.

    Raises:
      KeyError: an unknown name (the message lists the known ones).
    """
    if name not in _REGISTRY:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(names())}")
    return _REGISTRY[name](input_shape, num_classes, **hp)


from models import small  # noqa: E402,F401 -- registers the builders
