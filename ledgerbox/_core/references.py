"""``module:attribute`` references given as settings (``--app`` of ``ledgerbox consumer``,
``--kafka-oauth-token-provider``): imported in ONE way, and every way it can fail is one line
naming the setting, never a traceback (docs/configuration.md).

Like ``python -m``, the working directory is importable. A module that cannot be found, an
attribute it lacks, and an error raised by the module's own code while it is imported (its
author's bug: a ``NameError``, an import of a package that is not installed) are each a
:class:`~ledgerbox.ConfigurationError` whose ``setting`` is the setting's name; the message
gives the cause's first line and, for the module's own error (a ``sys.exit()`` on import
too), how to see its traceback. A
ledgerbox error raised while the module is imported (a ``ConsumerConfig`` it builds refused a
setting) is raised as it is: it already says what is wrong.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from ledgerbox._core.errors import ConfigurationError, LedgerboxError

__all__ = ["first_line", "import_reference"]


def first_line(exc: BaseException) -> str:
    """``"<ExceptionClass>: <first line of its message>"`` (the class alone without one)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def import_reference(reference: str, setting: str) -> Any:
    """The object ``module:attribute`` (``attribute`` may be dotted: ``pkg.mod:obj.inner``).

    Parameters
    ----------
    reference : str
        ``module:attribute``.
    setting : str
        The setting that gave it (``"app"``), named in the error and set as its ``setting``.

    Raises
    ------
    ledgerbox.ConfigurationError
        One line: the reference is not ``module:attribute``, the module is not found, its
        own code failed while it was imported, or it has no such attribute.
    """
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name.strip() or not attribute.strip():
        raise ConfigurationError(
            f"{setting} must be module:attribute (got {reference!r})", setting=setting
        )
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: the working directory is importable
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        wanted = exc.name is not None and (
            module_name == exc.name or module_name.startswith(exc.name + ".")
        )
        if wanted:  # the module itself (or its package) is not there
            raise ConfigurationError(
                f"{setting} {reference!r} cannot be imported ({first_line(exc)}): check the "
                f"module path, and that it is importable from {os.getcwd()} or the "
                "installed packages",
                setting=setting,
            ) from None
        raise _own_code(setting, reference, module_name, exc) from None
    except LedgerboxError:
        raise  # a ledgerbox object the module builds refused its settings: said as it is
    except (Exception, SystemExit) as exc:  # the module's own code failed while imported
        # SystemExit: a module that calls sys.exit() on import (a script) ended the command
        # with its code and no word.
        raise _own_code(setting, reference, module_name, exc) from None
    where = module_name
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigurationError(
                f"{setting} {reference!r} cannot be imported (AttributeError: {where} has no "
                f"attribute {part!r}): check the name after the colon",
                setting=setting,
            ) from None
        where = f"{where}.{part}"
    return target


def _own_code(
    setting: str, reference: str, module_name: str, exc: BaseException
) -> ConfigurationError:
    return ConfigurationError(
        f"{setting} {reference!r} cannot be imported (its module's own code raised "
        f"{first_line(exc)}): fix the module; `python -c 'import {module_name}'` shows the "
        "traceback",
        setting=setting,
    )
