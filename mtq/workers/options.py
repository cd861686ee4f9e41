"""Model options: settings a target declares, given with ``--set KEY=VALUE``.

A :class:`~mtq.Model` or :class:`~mtq.Generator` declares its options as class
attributes::

    class Embedder(mtq.Model):
        model = mtq.Option(str, help="a local folder or a hub name")      # required
        pooling = mtq.Option(str, "mean", choices=("mean", "cls"))
        normalize = mtq.Option(bool, True)

        def setup(self, device):
            self.net = load(self.model, pooling=self.pooling)

``mtq workers start app:Embedder -q emb --set model=/srv/minilm --set pooling=cls``
checks each value against its declaration before any process starts (an unknown
name, a value that does not parse, a missing required option: :class:`OptionError`,
exit 2; with no ``--set`` at all the supervisor leaves the import, and so a missing
required option, to its worker processes), and each worker process sets the values
on its model before ``setup``, where they read as plain attributes. In Python:
``Embedder().set_options(model=...)``. The values given are recorded in the model
catalogue (``mtq models``) and are part of the version (:mod:`mtq.workers.catalogue`).
``mtq rq worker --set CLASS.KEY=VALUE`` does the same for the models it serves
(:func:`mtq.rq.jobs.model_options`).

This module does not import torch.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from mtq.errors import OptionError

#: the default of an option that must be given
REQUIRED: Any = type("Required", (), {"__repr__": lambda self: "REQUIRED"})()

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("none", "null")
#: the attribute of a model instance that keeps the option values it was given
_GIVEN = "_mtq_options"
#: what each type of option takes, in messages
_TAKES = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


class Option:
    """One setting of a target: its type (``str``, ``int``, ``float`` or ``bool``), its
    default (:data:`REQUIRED` when it has none; ``None`` allowed, and then the text
    ``none`` gives None), the values it may take (``choices``), its range
    (``min``/``max``, for numbers) and a line of help for ``mtq models``."""

    __slots__ = ("choices", "default", "help", "max", "min", "name", "type")

    def __init__(self, type: type = str, default: Any = REQUIRED, *, help: str = "",
                 choices: Iterable[Any] | None = None, min: float | None = None,
                 max: float | None = None) -> None:
        if type not in (str, int, float, bool):
            raise TypeError(f"Option type must be str, int, float or bool, not {type!r}")
        if (min is not None or max is not None) and type not in (int, float):
            raise TypeError(f"Option min/max are for int and float options, not {type.__name__}")
        self.type = type
        self.default = default
        self.help = help
        self.choices = tuple(choices) if choices is not None else None
        self.min, self.max = min, max
        self.name = ""
        has_default = default is not REQUIRED and default is not None
        for value in (*(self.choices or ()), *((default,) if has_default else ())):
            if not self._is(value):
                raise TypeError(f"Option({type.__name__}): {value!r} (a default or a choice) "
                                f"is not {_TAKES[type]}")
        if has_default:
            try:
                self.default = self.check(default)  # in its choices and range; 1 -> 1.0
            except OptionError as exc:
                raise ValueError(f"Option default {default!r}: {exc}") from None

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        # only reached when the instance has no value of its own (a non-data
        # descriptor: a value set on the instance hides it)
        if obj is None:
            return self
        if self.default is REQUIRED:
            raise OptionError(f"{type(obj).__name__}: option {self.name!r} is required: give "
                              f"it with --set {self.name}=VALUE (or set_options({self.name}=...))")
        return self.default

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def parse(self, text: str) -> Any:
        """The value of ``text`` as given on a command line; OptionError if it is not one."""
        t = text.strip()
        if self.default is None and t.lower() in _NONE:
            return None
        if self.type is bool:
            if t.lower() in _TRUE:
                return self.check(True)
            if t.lower() in _FALSE:
                return self.check(False)
            raise OptionError(f"option {self.name!r} takes true or false, got {text!r}")
        if self.type in (int, float):
            try:
                value = self.type(t)
            except ValueError:
                raise OptionError(f"option {self.name!r} takes {_TAKES[self.type]}, "
                                  f"got {text!r}") from None
            return self.check(value)
        return self.check(text)

    def _is(self, value: Any) -> bool:
        """Whether ``value`` is of this option's type (a bool is no number here, an int
        is a float, NaN and infinities are no numbers)."""
        if isinstance(value, bool):
            return self.type is bool
        if self.type is float:
            return isinstance(value, (int, float)) and math.isfinite(value)
        return isinstance(value, self.type)

    def check(self, value: Any) -> Any:
        """``value`` if this option may take it (an int for a float option is taken as
        a float); OptionError naming what it may take otherwise."""
        if value is None and self.default is None:
            return None
        if not self._is(value):
            raise OptionError(f"option {self.name!r} takes {_TAKES[self.type]}"
                              + (" (or none)" if self.default is None else "")
                              + f", got {value!r}")
        if self.type is float:
            value = float(value)
        if self.choices is not None and value not in self.choices:
            raise OptionError(f"option {self.name!r} must be one of "
                              f"{', '.join(map(str, self.choices))}; got {value!r}")
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            lo = "" if self.min is None else f">= {self.min:g}"
            hi = "" if self.max is None else f"<= {self.max:g}"
            raise OptionError(f"option {self.name!r} must be {' and '.join(x for x in (lo, hi) if x)}"
                              f", got {value!r}")
        return value

    def describe(self) -> str:
        """``name (type, default ...)``: one line for help texts and errors."""
        what = self.type.__name__
        if self.choices is not None:
            what = "|".join(map(str, self.choices))
        elif self.min is not None or self.max is not None:
            what += f" {'' if self.min is None else f'{self.min:g}'}.." \
                    f"{'' if self.max is None else f'{self.max:g}'}"
        default = "required" if self.required else f"default {self.default!r}"
        return f"{self.name} ({what}, {default})" + (f": {self.help}" if self.help else "")


def declared(target: Any) -> dict[str, Option]:
    """The options a target (a class or an instance) declares, by name, in the order
    they were declared (a subclass's own after its bases')."""
    cls = target if isinstance(target, type) else type(target)
    out: dict[str, Option] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, Option):
                out[name] = value
            elif name in out:  # a subclass replaced the option with a plain attribute
                del out[name]
    return out


def parse_pairs(pairs: Iterable[str]) -> dict[str, str]:
    """``["KEY=VALUE", ...]`` (the ``--set`` options) as a dict; OptionError for one
    without ``=`` or with an empty key, or a key given twice."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise OptionError(f"--set takes KEY=VALUE, got {pair!r}")
        if key in out:
            raise OptionError(f"--set {key} is given twice")
        out[key] = value
    return out


def _known(options: Mapping[str, Option]) -> str:
    if not options:
        return "it declares no options"
    return "its options: " + "; ".join(o.describe() for o in options.values())


def resolve(target: Any, given: Mapping[str, Any], *, text: bool = False,
            name: str = "", prefix: str = "") -> dict[str, Any]:
    """Check ``given`` against the options ``target`` (a class, or an instance whose
    own attributes count as given) declares and return the values to set (parsed
    from text when ``text``). OptionError for an unknown name, a bad value or a
    required option missing; ``name`` names the target in its message, ``prefix``
    goes before the key in the ``--set`` it suggests."""
    options = declared(target)
    label = name or (target.__name__ if isinstance(target, type) else type(target).__name__)
    unknown = [k for k in given if k not in options]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(options), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise OptionError(f"{label!r} has no option {unknown[0]!r}{hint}; {_known(options)}")
    values: dict[str, Any] = {}
    for key, raw in given.items():
        opt = options[key]
        try:
            values[key] = opt.parse(raw) if text else opt.check(raw)
        except OptionError as exc:
            raise OptionError(f"{label!r}: {exc}") from None
    # an instance's own attribute (set_options, or set in its __init__) hides the option
    own = {} if isinstance(target, type) else getattr(target, "__dict__", {})
    missing = [k for k, o in options.items() if o.required and k not in values and k not in own]
    if missing:
        raise OptionError(f"{label!r}: option {missing[0]!r} is required: give it with "
                          f"--set {prefix}{missing[0]}=VALUE; {_known(options)}")
    return values


def apply(model: Any, given: Mapping[str, Any], *, text: bool = False, name: str = "",
          prefix: str = "") -> Any:
    """Set the option values ``given`` on ``model`` (checked by :func:`resolve`) and
    remember them for the catalogue; returns the model."""
    values = resolve(model, given, text=text, name=name, prefix=prefix)
    for key, value in values.items():
        setattr(model, key, value)
    setattr(model, _GIVEN, {**getattr(model, _GIVEN, {}), **values})
    return model


def given(model: Any) -> dict[str, Any]:
    """The option values set on ``model`` (for the catalogue)."""
    return dict(getattr(model, _GIVEN, {}))


def given_json(model: Any) -> str:
    """:func:`given` as a JSON object (the catalogue's ``options`` field)."""
    return json.dumps(given(model), sort_keys=True, default=str)


class Configurable:
    """The options side of :class:`~mtq.Model` and :class:`~mtq.Generator`."""

    def set_options(self, **values: Any) -> Any:
        """Set declared options (checked as on the command line); returns the model,
        so ``Embedder().set_options(model="/srv/minilm")`` serves as a target."""
        return apply(self, values, name=type(self).__name__)
