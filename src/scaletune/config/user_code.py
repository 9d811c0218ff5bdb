"""Your code named in the config (`model.factory`, `data.factory`): imported and called with its
keyword arguments checked first, every failure reported as bad input naming the key.

A reference is `package.module:callable` (importable from the Python path or the current
directory) or `path/to/file.py:callable`. It comes from your config only: nothing here imports
a name read from a checkpoint or a model folder.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pkgutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletune.errors import UserError


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _import_file(path: Path, key: str, ref: str) -> Any:
    if not path.is_file():
        raise UserError(f"{key} {ref!r}: no such file {path}", title="invalid factory")
    name = f"_scaletune_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before running it, as `import` does, so its classes pickle (DataLoader workers).
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise UserError(f"{key} {ref!r}: {path} does not import: {_first_line(exc)}", title="invalid factory") from exc
    return module


def import_callable(ref: str, key: str) -> Callable[..., Any]:
    """The callable `ref` names.

    Args:
        ref: `package.module:name` (`name` may be dotted: `module:Class.build`) or `file.py:name`.
        key: the config key it came from, for messages (`model.factory`).

    Raises:
        UserError: not of that form, the module does not import (its exception's first line is
            given), it has no such attribute, or the attribute is not callable.
    """
    module_name, sep, attr = ref.rpartition(":")
    if not sep or not module_name or not attr:
        raise UserError(
            f"{key} {ref!r}: expected 'package.module:callable' or 'path/to/file.py:callable'", title="invalid factory"
        )
    if module_name.endswith(".py"):
        module = _import_file(Path(module_name).expanduser().resolve(), key, ref)
    else:
        cwd = os.getcwd()
        if cwd not in sys.path and "" not in sys.path:
            sys.path.append(cwd)  # after the installed packages: a local file never shadows them
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            raise UserError(
                f"{key} {ref!r}: module {module_name!r} does not import: {_first_line(exc)}", title="invalid factory"
            ) from exc
    try:  # the dotted attribute path, as the standard library walks it
        obj = pkgutil.resolve_name(f"{module.__name__}:{attr}")
    except AttributeError:
        raise UserError(f"{key} {ref!r}: {module_name} has no attribute {attr!r}", title="invalid factory") from None
    if not callable(obj):
        raise UserError(f"{key} {ref!r}: {attr} is a {type(obj).__name__}, not a callable", title="invalid factory")
    return obj


def call_checked(fn: Callable[..., Any], kwargs: dict[str, Any], key: str, ref: str) -> Any:
    """`fn(**kwargs)`, with the arguments checked against its signature first, so that a wrong
    keyword is reported as bad input while a TypeError raised inside `fn` stays an error of `fn`.

    Raises:
        UserError: the keyword arguments do not fit the signature.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: let the call say it
        return fn(**kwargs)
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise UserError(
            f"{key} {ref!r} cannot be called with {sorted(kwargs) or 'no arguments'}: {exc} "
            f"(signature {ref.rpartition(':')[2]}{signature})",
            title="invalid factory",
        ) from None
    return fn(**kwargs)
