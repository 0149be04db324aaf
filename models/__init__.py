"""The model zoo: `build_<name>(input_shape, num_classes, **hp) -> keras.Model`, registered by name.

Models are returned uncompiled and output logits: the optimizer, loss and distribution are chosen
in one place (the trainer), never inside a model. Builders import Keras inside themselves, so
listing the models (`names`, `summary`) needs no TensorFlow.

A user's own models live in a Python file whose import registers them (`model.file` in a
config, or `load_file`):

    import models

    @models.register("my_net")
    def build_my_net(input_shape, num_classes, width=64):
        # The docstring's first paragraph is what `hvd-train models` shows.
        import keras
        ...
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from hvd_train.errors import UserError

Builder = Callable[..., Any]
_REGISTRY: dict[str, Builder] = {}
_LOADED: dict[str, list[str]] = {}  # real path of a loaded model file -> the names it registered


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


def summary(name: str) -> str:
    """The first paragraph of a registered builder's docstring, on one line ("" without one).

    Raises:
      KeyError: an unknown name (the message lists the known ones).
    """
    doc = inspect.getdoc(_builder(name)) or ""
    return " ".join(doc.split("\n\n")[0].split())


def parameters(name: str) -> set[str]:
    """The keyword arguments a registered builder takes, past input_shape and num_classes.

    Raises:
      KeyError: an unknown name (the message lists the known ones).
    """
    return set(list(inspect.signature(_builder(name)).parameters)[2:])


def build(name: str, input_shape: tuple[int, ...], num_classes: int, **hp: Any) -> Any:
    """Build a registered model.

    Raises:
      KeyError: an unknown name (the message lists the known ones).
    """
    return _builder(name)(input_shape, num_classes, **hp)


def load_file(path: str | os.PathLike[str]) -> list[str]:
    """Import a Python file whose import registers models with `@models.register`.

    The file is imported under a module name of its own, once per process: loading it again
    returns the same names. If its import fails, what it registered is unregistered.

    Args:
      path: the .py file.

    Returns:
      The names the file registered, sorted.

    Raises:
      UserError: one line naming the file: it is missing or not a .py file, its import raised
        (with the line, the exception type and message), or it registered no model.
    """
    shown = os.fspath(path)
    real = os.path.realpath(shown)
    if real in _LOADED:
        return list(_LOADED[real])
    if not os.path.isfile(real):
        raise UserError(f"{shown}: the model file does not exist")
    module_name = "hvd_train_user_models_" + hashlib.sha256(real.encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(module_name, real)
    if spec is None or spec.loader is None:
        raise UserError(f"{shown}: a model file must be a Python file (.py)")
    module = importlib.util.module_from_spec(spec)
    before = set(_REGISTRY)
    sys.modules[module_name] = module  # as `import` does: dataclasses and pickle look it up
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's code: whatever it raises is shown in one line
        del sys.modules[module_name]
        for name in set(_REGISTRY) - before:
            del _REGISTRY[name]
        raise UserError(
            f"{shown}{_line_in(real, err)}: importing the model file failed: "
            + " ".join(f"{type(err).__name__}: {err}".split())
        ) from err
    added = sorted(set(_REGISTRY) - before)
    if not added:
        raise UserError(
            f"{shown}: the model file registers no model "
            '(decorate a builder with @models.register("name"))'
        )
    _LOADED[real] = added
    return list(added)


def _builder(name: str) -> Builder:
    if name not in _REGISTRY:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(names())}")
    return _REGISTRY[name]


def _line_in(path: str, err: Exception) -> str:
    """The suffix ":N": the last line of `path` in the traceback (or its syntax error), or ""."""
    if isinstance(err, SyntaxError) and err.filename == path and err.lineno:
        return f":{err.lineno}"
    lines = [f.lineno for f in traceback.extract_tb(err.__traceback__) if f.filename == path]
    return f":{lines[-1]}" if lines else ""


# Register the zoo's builders (after `register` exists; none of these imports Keras).
from models import applications, recommender, resnet, small, transformer  # noqa: E402,F401
