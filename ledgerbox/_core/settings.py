"""Command-line settings of the ledgerbox commands: one naming scheme, one mechanism.

The scheme (docs/configuration.md), the same for ``ledgerbox relay``, ``ledgerbox consumer``
and ``ledgerbox migrate``: setting ``field_name`` of command ``<command>`` has

* ONE flag, ``--field-name``;
* ONE environment variable, ``LEDGERBOX_<COMMAND>_FIELD_NAME``; connection URLs also read the
  well-known name (``DATABASE_URL``, ``KAFKA_BOOTSTRAP_SERVERS``, ``REDIS_URL``), the prefixed
  one wins.

Precedence: the flag, then the prefixed variable, then the well-known one, then a deprecated
name, then the default. Exception: a :attr:`Setting.command_line` setting (and a name a command
lists in ``command_line``) is read from its flag only, never from a variable: the selection and
the actor of an operator command are what the operator typed. An empty variable counts as
unset. A renamed setting keeps its old names for one release: using one prints ONE line to
stderr (``ledgerbox: OLD is deprecated, use NEW``) and emits a :class:`DeprecationWarning`. An
invalid setting exits with code 2 and ONE line that names the setting, its flag and every
variable that sets it, e.g. ``ledgerbox relay: batch_size must be in 1..100000 (got 0); set
--batch-size or LEDGERBOX_RELAY_BATCH_SIZE``. The value of a secret setting (a URL with a
password) is never printed.

The settings of a config dataclass are derived from it (:func:`settings_from_dataclass`: its
fields, types, defaults and numpydoc ``Parameters``), and typer options are generated from
the settings (:meth:`CommandSettings.typer_command`, an ``inspect.Signature``), so flags, variables
and documentation cannot drift apart. Environment values are read and typed by
pydantic-settings; flags are typed by the same pydantic types, so a bad flag and a bad
variable get the same one-line error.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import re
import time
import types
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any, Literal, NoReturn

import pydantic
import typer
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from ledgerbox._core.errors import ConfigurationError

__all__ = [
    "CommandSettings",
    "RepeatFilter",
    "Setting",
    "SettingsError",
    "Values",
    "settings_from_dataclass",
    "warn_deprecated",
]

#: Resolved settings of one command invocation: setting name -> typed value (``None``: unset).
Values = dict[str, Any]

_UNITS = (("_ms", "ms"), ("_s", "s"), ("_bytes", "bytes"))
_METAVARS = {int: "INTEGER", float: "NUMBER", str: "TEXT"}
# Model fields are prefixed: a setting may be called like a pydantic attribute ("schema").
_FIELD = "v_"
_WARNED: set[str] = set()


class SettingsError(ConfigurationError):
    """A setting could not be read or is invalid; ``setting`` names it."""

    __module__ = "ledgerbox._core.settings"


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting of a command.

    Attributes
    ----------
    name : str
        The field name, e.g. ``"batch_size"`` (flag ``--batch-size``).
    type : type
        ``str``, ``int`` or ``float``.
    default : object
        Value when nothing sets it (``None``: unset).
    required : bool
        Unset is an error (``"no <label>"``).
    help : str
        One line for ``--help`` and docs/configuration.md.
    unit : str
        ``"s"``, ``"ms"``, ``"bytes"`` or ``""`` (derived from the name's suffix).
    choices : tuple[str, ...]
        Allowed values, for the help text (the config validates them).
    well_known : tuple[str, ...]
        Unprefixed variables that also set it, below the prefixed one (``DATABASE_URL``).
    secret : bool
        Never print the value (URLs may carry a password).
    label : str
        Name used in "no <label>" (default: the name).
    old_env, old_flags : tuple[str, ...]
        Deprecated names that still work for one release.
    command_line : bool
        Read from its flag only, never from the environment: what an operator command acts
        on (its selection filters, its actor) must be what the operator typed, not a
        variable left in a shell (docs/operations.md).
    """

    name: str
    type: type[Any]
    default: Any = None
    required: bool = False
    help: str = ""
    unit: str = ""
    choices: tuple[str, ...] = ()
    well_known: tuple[str, ...] = ()
    secret: bool = False
    label: str = ""
    old_env: tuple[str, ...] = ()
    old_flags: tuple[str, ...] = ()
    command_line: bool = False

    @property
    def flag(self) -> str:
        """``--field-name``."""
        return "--" + self.name.replace("_", "-")


def settings_from_dataclass(cls: type[Any], **changes: Mapping[str, Any]) -> list[Setting]:
    """One :class:`Setting` per init field of the dataclass ``cls``: type and choices from
    the annotation (``Literal`` -> ``str`` with choices, ``X | None`` -> ``X``), default and
    ``required`` from the field, help from the class docstring's numpydoc ``Parameters``
    (first sentence), unit from the name's suffix. ``changes`` maps a field name to
    attributes to override (e.g. ``database_url={"well_known": ("DATABASE_URL",)}``). A field
    whose metadata holds ``{"setting": False}`` is not a setting (an object such as
    ``RelayConfig.kafka``, whose own settings the command adds).

    Raises
    ------
    TypeError
        If a field has a type other than str, int, float (optional or literal), or a
        ``changes`` key is not a field.
    """
    hints = typing.get_type_hints(cls)
    docs = _parameter_docs(cls.__doc__ or "")
    result: list[Setting] = []
    names = set()
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("setting") is False:
            continue
        names.add(f.name)
        base, choices = _base_type(hints[f.name])
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        setting = Setting(
            name=f.name,
            type=base,
            default=None if no_default else f.default,
            required=no_default,
            help=docs.get(f.name, ""),
            unit=next((u for suffix, u in _UNITS if f.name.endswith(suffix)), ""),
            choices=choices,
        )
        result.append(dataclasses.replace(setting, **changes.get(f.name, {})))
    unknown = set(changes) - names
    if unknown:
        raise TypeError(f"not fields of {cls.__name__}: {sorted(unknown)}")
    return result


class CommandSettings:
    """The settings of one command under the scheme of the module docstring.

    Parameters
    ----------
    command : str
        ``"relay"``, ``"consumer"``, ``"migrate"``: messages start ``ledgerbox <command>:``,
        variables ``LEDGERBOX_<COMMAND>_``.
    settings : Sequence[Setting]
    old_prefix : str | None
        A former prefix of every variable (e.g. ``"LEDGERBOX_INBOX_"``), deprecated.
    """

    def __init__(
        self, command: str, settings: Sequence[Setting], *, old_prefix: str | None = None
    ) -> None:
        self.command = command
        self.prefix = f"LEDGERBOX_{command.upper()}_"
        self.settings: dict[str, Setting] = {}
        for s in settings:
            if old_prefix is not None:
                s = dataclasses.replace(s, old_env=(*s.old_env, old_prefix + s.name.upper()))
            self.settings[s.name] = s

    def env(self, name: str) -> str:
        """The prefixed variable of setting ``name``."""
        return self.prefix + name.upper()

    def env_names(self, name: str) -> tuple[str, ...]:
        """Every current variable of setting ``name``, in precedence order (none for a
        :attr:`Setting.command_line` one)."""
        if self.settings[name].command_line:
            return ()
        return (self.env(name), *self.settings[name].well_known)

    def where(self, name: str, *, flag_only: bool = False) -> str:
        """``"--batch-size or LEDGERBOX_RELAY_BATCH_SIZE"``: every way to set ``name``
        (``flag_only``: a command that reads it from its flag only: the flag)."""
        ways = [self.settings[name].flag, *(() if flag_only else self.env_names(name))]
        return ways[0] if len(ways) == 1 else f"{', '.join(ways[:-1])} or {ways[-1]}"

    def defaults(self) -> Values:
        """The default of every setting (``None``: unset)."""
        return {name: s.default for name, s in self.settings.items()}

    # -- reading -------------------------------------------------------------------------

    def resolve(
        self,
        names: Sequence[str],
        flags: Mapping[str, str | None],
        command_line: Sequence[str] = (),
    ) -> Values:
        """The typed values of ``names`` from ``flags`` (given on the command line; ``None``:
        not given, keys of deprecated flags included) and the environment, defaults applied.
        The names in ``command_line`` (and every :attr:`Setting.command_line` setting) come
        from ``flags`` only: their variables are not read.

        Raises
        ------
        SettingsError
            A value does not parse as the setting's type, or a required one is unset.
        """
        given = dict(flags)
        for name in names:
            s = self.settings[name]
            for old in s.old_flags:
                value = given.pop(_param(old), None)
                if value is not None:
                    warn_deprecated(old, s.flag)
                    if given.get(name) is None:
                        given[name] = value
            if name in command_line:
                continue
            for old in s.old_env:
                if os.environ.get(old) and not s.command_line:
                    warn_deprecated(old, self.env(name))
        from_env = self._read(
            [n for n in names if n not in command_line and not self.settings[n].command_line],
            None,
        )
        from_flags = self._read(names, {n: v for n, v in given.items() if v is not None})
        values: Values = {}
        for name in names:
            s = self.settings[name]
            value = from_flags.get(name)
            if value is None:
                value = from_env.get(name)
            if value is None:
                value = s.default
            if value is None and s.required:
                raise SettingsError(f"no {s.label or s.name}", setting=name)
            values[name] = value
        return values

    def _read(self, names: Sequence[str], flags: Mapping[str, str] | None) -> Values:
        model = _model(self, tuple(names), from_env=flags is None)
        try:
            if flags is None:
                parsed = model()
            else:
                parsed = model.model_validate({_FIELD + n: v for n, v in flags.items()})
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            key = str(first["loc"][0]) if first["loc"] else ""
            name = next(
                (n for n in names if key in (_FIELD + n, *self._all_env(n))),
                names[0] if names else "",
            )
            s = self.settings[name]
            kind = {int: "an integer", float: "a number"}.get(s.type, "text")
            if first["type"] == "finite_number":  # inf, nan
                kind = "a finite number"
            source = "" if flags is not None else f" from {key}"
            shown = "" if s.secret else f" (got {first.get('input')!r}{source})"
            raise SettingsError(f"{name} must be {kind}{shown}", setting=name) from None
        return {name: getattr(parsed, _FIELD + name) for name in names}

    def _all_env(self, name: str) -> tuple[str, ...]:
        if self.settings[name].command_line:
            return ()
        return (*self.env_names(name), *self.settings[name].old_env)

    # -- errors ----------------------------------------------------------------------------

    def error_line(
        self,
        exc: ConfigurationError,
        values: Mapping[str, Any],
        *,
        command: str | None = None,
        flag_only: bool = False,
    ) -> str:
        """The one line for ``exc``: ``ledgerbox <command>: <problem> (got <value>); set
        <flag> or <variables>`` (no value for secrets, no "set" part for an unknown setting).
        ``command``: the command's full name (``"consumer dlq list"``; default: this
        settings' command); ``flag_only``: the command reads the setting from its flag only
        (its variables are not named).
        """
        name = exc.setting
        problem = str(exc)
        prefix = f"ledgerbox {command or self.command}"
        if name is None or name not in self.settings:
            return f"{prefix}: {problem}"
        s = self.settings[name]
        value = values.get(name)
        # Already in the problem: a bad identifier quotes it, a range check says "(got ...)".
        shown = "(got " in problem or (isinstance(value, str) and repr(value) in problem)
        if not s.secret and value is not None and not shown:
            problem = f"{problem} (got {value!r})"
        return f"{prefix}: {problem}; set {self.where(name, flag_only=flag_only)}"

    def fail(
        self,
        exc: ConfigurationError,
        values: Mapping[str, Any] | None = None,
        *,
        command: str | None = None,
        flag_only: bool = False,
    ) -> NoReturn:
        """Print :meth:`error_line` to stderr and exit with code 2."""
        typer.echo(
            self.error_line(exc, values or {}, command=command, flag_only=flag_only), err=True
        )
        raise typer.Exit(2)

    # -- typer -----------------------------------------------------------------------------

    def option_help(self, name: str, *, command_line: bool = False) -> str:
        """``--help`` text: the help line, unit, choices, default and variables (``command
        line only`` for a setting this command reads from its flag only)."""
        s = self.settings[name]
        parts = [s.help.rstrip(".")] if s.help else []
        if s.unit:
            parts.append(f"unit: {s.unit}")
        if s.choices:
            parts.append("one of " + "|".join(s.choices))
        if s.default is not None and not s.secret:
            parts.append(f"default: {s.default}")
        env = self.env_names(name)
        parts.append("command line only" if command_line or not env else "env: " + ", ".join(env))
        return _not_markup("; ".join(parts))

    def typer_command(
        self,
        app: typer.Typer,
        command_name: str,
        names: Sequence[str],
        *,
        switches: Mapping[str, str] | None = None,
        arguments: Mapping[str, str] | None = None,
        command_line: Sequence[str] = (),
        full_name: str | None = None,
    ) -> Callable[[Callable[[Values, typer.Context], None]], Callable[..., None]]:
        """Register ``body(values, ctx)`` as ``app``'s sub-command ``command_name`` with one
        option per setting in ``names`` (plus hidden deprecated flags). ``values`` are the
        resolved settings; a :class:`SettingsError` exits with code 2 and one line. The
        body's docstring is the command's help.

        ``switches``: name -> help of boolean flags of this command only (``--dry-run``,
        ``--force``), given on the command line and never read from the environment (an
        operator's ``--force`` must not be inherited from a shell); ``values[name]`` is
        ``True`` or ``False``.

        ``arguments``: name -> help of positional arguments of this command only (row ids,
        record references), each taking any number of values; ``values[name]`` is a list of
        strings (empty when none is given).

        ``command_line``: settings of ``names`` this command reads from their flags only,
        never from the environment (the selection and the actor of an operator command: it
        acts only on what the operator typed); other commands may still read their
        variables.

        ``full_name``: the command's name in a refusal of its settings (``"relay dead
        list"``), as its other refusals name it; default: this settings' command
        (``"relay"``). A setting of ``command_line`` is then named by its flag only.
        """
        switches = dict(switches or {})
        command_line = tuple(command_line)
        arguments = dict(arguments or {})

        def decorate(body: Callable[[Values, typer.Context], None]) -> Callable[..., None]:
            def handler(ctx: typer.Context, **given: Any) -> None:
                flags: dict[str, Any] = {n: bool(given.pop(n, False)) for n in switches}
                flags.update({n: list(given.pop(n, None) or ()) for n in arguments})
                try:
                    values = self.resolve(names, given, command_line)
                except SettingsError as exc:
                    self.fail(exc, command=full_name, flag_only=exc.setting in command_line)
                body({**values, **flags}, ctx)

            params = [
                inspect.Parameter(
                    "ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context
                )
            ]
            for name, text in arguments.items():
                params.append(
                    inspect.Parameter(
                        name,
                        inspect.Parameter.POSITIONAL_OR_KEYWORD,
                        default=None,
                        annotation=Annotated[
                            list[str] | None, typer.Argument(help=text, show_default=False)
                        ],
                    )
                )
            for name in names:
                s = self.settings[name]
                option = typer.Option(
                    s.flag,
                    help=self.option_help(name, command_line=name in command_line),
                    show_default=False,
                    metavar="|".join(s.choices) or _METAVARS[s.type],
                )
                params.append(_option_param(name, option))
                for old in s.old_flags:
                    params.append(_option_param(_param(old), typer.Option(old, hidden=True)))
            for name, text in switches.items():
                params.append(
                    inspect.Parameter(
                        name,
                        inspect.Parameter.KEYWORD_ONLY,
                        default=False,
                        annotation=Annotated[
                            bool, typer.Option("--" + name.replace("_", "-"), help=text)
                        ],
                    )
                )
            handler.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
            handler.__doc__ = body.__doc__
            app.command(command_name)(handler)
            return handler

        return decorate


def _not_markup(text: str) -> str:
    """``text`` for typer's help, which reads rich markup when rich is installed: square
    brackets stay text (``[[service]]`` was shown as ``[]``, eaten as a markup tag)."""
    try:
        from rich.markup import escape
    except ImportError:  # typer without rich prints the text as it is
        return text
    return escape(text)


#: The ``--log-level`` values (any case), as docs/configuration.md lists them.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

#: The ``log_level`` setting of the daemons and the console: its help lists
#: :data:`LOG_LEVELS`, the ones :func:`configure_logging` accepts.
LOG_LEVEL_SETTING = Setting(
    "log_level",
    str,
    default="INFO",
    help=f"Logging level ({', '.join(LOG_LEVELS[:-1])} or {LOG_LEVELS[-1]})",
)


def configure_logging(settings: CommandSettings, level: str) -> None:
    """``logging.basicConfig`` at ``level`` (any case), with the Kafka client's repeated lines
    rate-limited (:class:`RepeatFilter`); an unknown level exits with code 2 and one line
    naming the ``log_level`` setting."""
    upper = level.upper()
    if upper not in LOG_LEVELS:
        listed = f"{', '.join(LOG_LEVELS[:-1])} or {LOG_LEVELS[-1]}"
        settings.fail(
            SettingsError(f"log_level must be {listed}", setting="log_level"),
            {"log_level": level},
        )
    logging.basicConfig(level=upper, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RepeatFilter())


class RepeatFilter(logging.Filter):
    """Lets one line of each kind through per ``window_s`` for the loggers under ``prefix``.

    aiokafka logs "Unable connect to node ..." at ERROR on every reconnect attempt (every
    50 ms): ~75 lines a second per daemon while one broker is down (soak finding). The
    daemons report the outage themselves, once per change of state; of aiokafka's lines the
    first of a kind (same logger, level and message template) passes, the repeats within
    the window are counted, and the next one after it says how many were dropped.

    Parameters
    ----------
    prefix : str
        Logger names this applies to (default ``"aiokafka"``); others always pass.
    window_s : float
        Seconds during which a repeat of a line is dropped (default 30).
    clock : Callable[[], float]
        Monotonic clock in seconds.
    """

    def __init__(
        self,
        prefix: str = "aiokafka",
        window_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._prefix = prefix
        self._window_s = window_s
        self._clock = clock
        self._seen: dict[tuple[str, int, object], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self._prefix):
            return True
        key = (record.name, record.levelno, record.msg)
        now = self._clock()
        since, dropped = self._seen.get(key, (-float("inf"), 0))
        if now - since < self._window_s:
            self._seen[key] = (since, dropped + 1)
            return False
        self._seen[key] = (now, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} similar lines in the last {self._window_s:g} s)"
        return True


def warn_deprecated(old: str, new: str) -> None:
    """Once per process and name: print ``ledgerbox: OLD is deprecated, use NEW`` to stderr
    and emit a :class:`DeprecationWarning`."""
    if old in _WARNED:
        return
    _WARNED.add(old)
    message = f"ledgerbox: {old} is deprecated, use {new}"
    typer.echo(message, err=True)
    warnings.warn(message, DeprecationWarning, stacklevel=3)


# -- internals ---------------------------------------------------------------------------------


def _param(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _option_param(name: str, option: Any) -> inspect.Parameter:
    return inspect.Parameter(
        name,
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[str | None, option],
    )


@lru_cache(maxsize=32)
def _model(settings: CommandSettings, names: tuple[str, ...], *, from_env: bool) -> Any:
    """A pydantic model of ``names``: from the environment (pydantic-settings, every variable
    of each setting as aliases in precedence order) or from flag strings (by name)."""
    fields: dict[str, Any] = {}
    for name in names:
        s = settings.settings[name]
        # A number setting is finite: "inf" and "nan" parse as floats, and no setting means
        # them (a duration of inf: a relay that never polls; docs/configuration.md).
        finite: dict[str, Any] = {"allow_inf_nan": False} if s.type is float else {}
        if from_env:
            aliases = AliasChoices(*settings._all_env(name))
            fields[_FIELD + name] = (
                s.type | None,
                Field(default=None, validation_alias=aliases, **finite),
            )
        else:
            fields[_FIELD + name] = (s.type | None, Field(default=None, **finite))
    base: type[Any] = _EnvBase if from_env else _FlagBase
    model_name = f"{settings.command}_{'env' if from_env else 'flags'}"
    return pydantic.create_model(model_name, __base__=base, **fields)


class _EnvBase(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore", case_sensitive=True, env_ignore_empty=True)


class _FlagBase(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="ignore")


def _base_type(hint: Any) -> tuple[type[Any], tuple[str, ...]]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _base_type(rest[0])
    if typing.get_origin(hint) is Literal:
        return str, tuple(str(a) for a in args)
    if hint in (str, int, float):
        return typing.cast(type[Any], hint), ()
    raise TypeError(f"unsupported setting type {hint!r}")


def _parameter_docs(doc: str) -> dict[str, str]:
    """First sentence of each entry of a numpydoc ``Parameters`` section, by name."""
    lines = inspect.cleandoc(doc).splitlines()
    out: dict[str, str] = {}
    try:
        start = lines.index("Parameters") + 2
    except ValueError:
        return out
    current: list[str] = []
    text: list[str] = []

    def flush() -> None:
        sentence = " ".join(text).replace("``", "").split(". ")[0].strip()
        # "(default 8, 1..64)" -> "(1..64)", "(default 1000)" -> "": the help adds the default.
        sentence = re.sub(r"\(default [^,)]*, ", "(", sentence)
        sentence = re.sub(r"\s*\(default[^)]*\)", "", sentence)
        for name in current:
            out[name] = sentence.rstrip(".")

    for i in range(start, len(lines)):
        line = lines[i]
        if i + 1 < len(lines) and set(lines[i + 1]) == {"-"} and line and line[0] != " ":
            break  # the next section
        if line and line[0] != " ":
            flush()
            current = [n.strip() for n in line.split(" : ")[0].split(",")]
            text = []
        elif line.strip():
            text.append(line.strip())
    flush()
    return out
