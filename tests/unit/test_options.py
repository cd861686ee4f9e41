"""Model options (mtq.Option): declaring, parsing ``--set`` text, checking values,
inheritance, ``set_options`` in Python, loading a target with options, and the
version and catalogue record they give. No Redis, no worker processes (see
tests/integration/test_model_options.py for those)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

import mtq
from mtq.errors import OptionError, TargetError
from mtq.workers import catalogue
from mtq.workers.options import declared, given, parse_pairs, resolve
from mtq.workers.target import check_options, load_model
from tests.models import Configured


class Emb(mtq.Model):
    model = mtq.Option(str, help="a folder")
    pooling = mtq.Option(str, "mean", choices=("mean", "cls"))
    normalize = mtq.Option(bool, True)
    max_length = mtq.Option(int, 512, min=1, max=8192)
    temperature = mtq.Option(float, 1.0, min=0.0)
    revision = mtq.Option(str, None)
    flag = mtq.Option(bool, None)

    def predict(self, batch: list[Any]) -> list[Any]:
        return batch


class Gen(mtq.Generator):
    steps = mtq.Option(int, 4, min=1)

    def prefill(self, requests: list[Any]) -> list[Any]:
        return []

    def decode(self, requests: list[Any]) -> list[Any]:
        return []


def parsed(**text: str) -> dict[str, Any]:
    return resolve(Emb, {"model": "/m", **text}, text=True)


# -- parsing the text of --set ---------------------------------------------------------
@pytest.mark.parametrize("text,value", [
    ({"max_length": "64"}, {"max_length": 64}),
    ({"max_length": " 64 "}, {"max_length": 64}),
    ({"temperature": "0.5"}, {"temperature": 0.5}),
    ({"temperature": "2"}, {"temperature": 2.0}),
    ({"normalize": "false"}, {"normalize": False}),
    ({"normalize": "No"}, {"normalize": False}),
    ({"normalize": "0"}, {"normalize": False}),
    ({"normalize": "off"}, {"normalize": False}),
    ({"normalize": "TRUE"}, {"normalize": True}),
    ({"normalize": "yes"}, {"normalize": True}),
    ({"normalize": "1"}, {"normalize": True}),
    ({"normalize": "on"}, {"normalize": True}),
    ({"pooling": "cls"}, {"pooling": "cls"}),
    ({"revision": "none"}, {"revision": None}),
    ({"revision": "NULL"}, {"revision": None}),
    ({"revision": "main"}, {"revision": "main"}),
    ({"flag": "none"}, {"flag": None}),
    ({"flag": "on"}, {"flag": True}),
])
def test_text_values_parse_to_their_type(text: dict[str, str], value: dict[str, Any]) -> None:
    out = parsed(**text)
    assert out == {"model": "/m", **value}
    for k, v in value.items():
        assert type(out[k]) is type(v)


def test_a_string_option_keeps_its_text_as_given() -> None:
    # "none" is None only for an option whose default is None; spaces are kept
    assert parsed(model=" none ")["model"] == " none "
    assert parsed(model="a=b")["model"] == "a=b"


@pytest.mark.parametrize("text,says", [
    ({"max_length": "lots"}, "option 'max_length' takes an integer, got 'lots'"),
    ({"max_length": "1.5"}, "takes an integer"),
    ({"max_length": "0"}, "option 'max_length' must be >= 1 and <= 8192, got 0"),
    ({"max_length": "9000"}, "must be >= 1 and <= 8192, got 9000"),
    ({"max_length": "none"}, "takes an integer"),  # its default is not None
    ({"temperature": "-0.1"}, "option 'temperature' must be >= 0, got -0.1"),
    ({"temperature": "nan"}, "option 'temperature' takes a number"),
    ({"temperature": "warm"}, "takes a number, got 'warm'"),
    ({"normalize": "maybe"}, "option 'normalize' takes true or false, got 'maybe'"),
    ({"normalize": ""}, "takes true or false"),
    ({"pooling": "max"}, "option 'pooling' must be one of mean, cls; got 'max'"),
    ({"pooling": "none"}, "must be one of mean, cls"),
])
def test_a_value_the_option_cannot_take_is_a_named_error(text: dict[str, str],
                                                          says: str) -> None:
    with pytest.raises(OptionError) as info:
        parsed(**text)
    assert says in str(info.value)
    assert str(info.value).startswith("'Emb': ")


def test_an_unknown_option_names_the_declared_ones_and_a_close_match() -> None:
    with pytest.raises(OptionError) as info:
        resolve(Emb, {"model": "/m", "poolng": "cls"}, text=True, name="app:Emb")
    msg = str(info.value)
    assert "'app:Emb' has no option 'poolng' (did you mean 'pooling'?)" in msg
    assert "pooling (mean|cls, default 'mean')" in msg
    assert "model (str, required): a folder" in msg
    assert "max_length (int 1..8192, default 512)" in msg
    with pytest.raises(OptionError, match="has no option 'zzz'; its options"):
        resolve(Emb, {"zzz": "1"}, text=True)


def test_a_required_option_missing_says_how_to_give_it() -> None:
    with pytest.raises(OptionError) as info:
        resolve(Emb, {"pooling": "cls"}, text=True, name="app:Emb")
    assert "'app:Emb': option 'model' is required: give it with --set model=VALUE" \
        in str(info.value)
    with pytest.raises(OptionError, match=r"--set app\.models\.Emb\.model=VALUE"):
        resolve(Emb, {}, text=True, name="app.models.Emb", prefix="app.models.Emb.")


def test_a_target_that_declares_none_says_so() -> None:
    class Plain(mtq.Model):
        def predict(self, batch: list[Any]) -> list[Any]:
            return batch

    assert resolve(Plain, {}) == {}
    with pytest.raises(OptionError, match="has no option 'x'; it declares no options"):
        resolve(Plain, {"x": "1"}, text=True)


# -- --set pairs --------------------------------------------------------------------------
def test_parse_pairs() -> None:
    assert parse_pairs(["a=1", " b =x=y", "c="]) == {"a": "1", "b": "x=y", "c": ""}
    assert parse_pairs([]) == {}


@pytest.mark.parametrize("pairs,says", [
    (["model"], "--set takes KEY=VALUE, got 'model'"),
    (["=x"], "--set takes KEY=VALUE, got '=x'"),
    ([" =x"], "--set takes KEY=VALUE"),
    (["a=1", "a=2"], "--set a is given twice"),
])
def test_malformed_or_repeated_pairs(pairs: list[str], says: str) -> None:
    with pytest.raises(OptionError, match=says):
        parse_pairs(pairs)


# -- declaring ----------------------------------------------------------------------------
def test_declared_follows_inheritance_and_overrides() -> None:
    class Base(mtq.Model):
        a = mtq.Option(int, 1)
        b = mtq.Option(str, "x")
        c = mtq.Option(bool, False)

        def predict(self, batch: list[Any]) -> list[Any]:
            return batch

    class Child(Base):
        b = mtq.Option(str, "y", choices=("y", "z"))  # redeclared: its own
        c = True  # a plain attribute: no longer an option
        d = mtq.Option(float, 0.5)

    assert list(declared(Base)) == ["a", "b", "c"]
    assert list(declared(Child)) == ["a", "b", "d"]
    assert declared(Child())["b"].choices == ("y", "z")
    assert Child().b == "y" and Base().b == "x" and Child().c is True
    with pytest.raises(OptionError, match="has no option 'c'"):
        resolve(Child, {"c": "true"}, text=True)
    with pytest.raises(OptionError, match="must be one of y, z"):
        resolve(Child, {"b": "x"}, text=True)


def test_option_reads_as_its_default_and_the_class_attribute_is_the_option() -> None:
    e = Emb()
    assert (e.pooling, e.normalize, e.max_length, e.revision) == ("mean", True, 512, None)
    assert isinstance(Emb.pooling, mtq.Option) and Emb.pooling.name == "pooling"
    with pytest.raises(OptionError, match="option 'model' is required: give it with --set"):
        e.model  # noqa: B018


@pytest.mark.parametrize("make,error,says", [
    (lambda: mtq.Option(list), TypeError, "must be str, int, float or bool"),
    (lambda: mtq.Option(str, min=1), TypeError, "min/max are for int and float"),
    (lambda: mtq.Option(int, "5"), TypeError, "'5' (a default or a choice) is not an integer"),
    (lambda: mtq.Option(int, True), TypeError, "is not an integer"),
    (lambda: mtq.Option(str, "a", choices=("b", 1)), TypeError, "1 (a default or a choice)"),
    (lambda: mtq.Option(str, "a", choices=("b", "c")), ValueError, "must be one of b, c"),
    (lambda: mtq.Option(int, 0, min=1), ValueError, "Option default 0"),
])
def test_a_bad_declaration_fails_at_class_creation(make: Any, error: type, says: str) -> None:
    with pytest.raises(error) as info:
        make()
    assert says in str(info.value)


def test_a_float_option_takes_an_int_default_as_a_float() -> None:
    opt = mtq.Option(float, 1)
    assert opt.default == 1.0 and isinstance(opt.default, float)


# -- set_options in Python ------------------------------------------------------------------
def test_set_options_checks_typed_values_and_returns_the_model() -> None:
    e = Emb()
    assert e.set_options(model="/srv/m", max_length=128, temperature=2) is e
    assert (e.model, e.max_length, e.temperature) == ("/srv/m", 128, 2.0)
    assert isinstance(e.temperature, float)
    assert given(e) == {"model": "/srv/m", "max_length": 128, "temperature": 2.0}
    e.set_options(pooling="cls")  # a later call adds to the earlier ones
    assert given(e) == {"model": "/srv/m", "max_length": 128, "temperature": 2.0,
                        "pooling": "cls"}
    assert Emb().pooling == "mean", "set on the instance, not the class"


@pytest.mark.parametrize("values,says", [
    ({"model": "/m", "max_length": "128"}, "option 'max_length' takes an integer, got '128'"),
    ({"model": "/m", "normalize": 1}, "option 'normalize' takes true or false, got 1"),
    ({"model": "/m", "max_length": True}, "takes an integer, got True"),
    ({"model": "/m", "max_length": 2.0}, "takes an integer, got 2.0"),
    ({"model": "/m", "revision": 3}, "takes a string (or none), got 3"),
    ({"model": None}, "option 'model' takes a string, got None"),
    ({"model": "/m", "nope": 1}, "'Emb' has no option 'nope'"),
    ({"pooling": "cls"}, "option 'model' is required"),
])
def test_set_options_refuses_what_the_command_line_would(values: dict[str, Any],
                                                         says: str) -> None:
    e = Emb()
    with pytest.raises(OptionError) as info:
        e.set_options(**values)
    assert says in str(info.value)
    assert given(e) == {}, "nothing set when a value is refused"


def test_a_required_option_set_in_python_counts_as_given() -> None:
    class Own(Emb):
        def __init__(self) -> None:
            self.model = "/from/init"

    assert resolve(Own(), {}) == {}
    e = Emb().set_options(model="/m")
    assert resolve(e, {"pooling": "cls"}) == {"pooling": "cls"}


def test_a_generator_takes_options_too() -> None:
    g = Gen().set_options(steps=9)
    assert g.steps == 9 and given(g) == {"steps": 9}
    with pytest.raises(OptionError, match="must be >= 1"):
        Gen().set_options(steps=0)


def test_option_errors_are_target_errors() -> None:
    # the CLI maps a TargetError to exit 2; callers that catch ValueError catch it too
    assert issubclass(OptionError, TargetError) and issubclass(OptionError, ValueError)
    assert mtq.OptionError is OptionError


# -- loading a target -----------------------------------------------------------------------
def test_load_model_sets_the_text_options_before_setup() -> None:
    m = load_model("tests.models:Configured",
                   options={"model": "/x", "layers": "3", "normalize": "no"})
    assert isinstance(m, Configured)
    m.setup("cpu")
    assert m.seen == {"model": "/x", "pooling": "mean", "normalize": False, "layers": 3,
                      "scale": 1.0, "revision": None}
    with pytest.raises(OptionError, match=re.escape("'tests.models:Configured': option "
                                                    "'model' is required")):
        load_model("tests.models:Configured")


def test_check_options_imports_without_constructing() -> None:
    check_options("tests.models:Configured", {"model": "/x"})
    with pytest.raises(OptionError, match="has no option 'layer' \\(did you mean 'layers'"):
        check_options("tests.models:Configured", {"model": "/x", "layer": "2"})
    with pytest.raises(OptionError, match=re.escape("'tests.models:Configured': option "
                                                    "'layers' must be >= 1 and <= 8")):
        check_options("tests.models:Configured", {"model": "/x", "layers": "9"})


def test_a_plain_function_target_takes_no_options() -> None:
    load_model("tests.handlers:double", options={})
    with pytest.raises(OptionError, match="is a plain function: it declares no options"):
        load_model("tests.handlers:double", options={"x": "1"})
    with pytest.raises(OptionError, match=re.escape("is not an mtq.Model or mtq.Generator")):
        check_options("tests.handlers:double", {"x": "1"})
    check_options("tests.handlers:double", {})


def test_the_hf_alias_names_mtq_s_backends() -> None:
    with pytest.raises(TargetError, match=re.escape("module 'mtq.backends.hf' has no "
                                                    "attribute 'NoSuch'")):
        load_model("hf:NoSuch")


# -- version and catalogue record -----------------------------------------------------------
def _version(spec: str, **options: str) -> str:
    m = load_model(spec, options=options)
    m.setup("cpu")
    return catalogue.version_of(m)


def test_the_version_follows_the_options() -> None:
    a = _version("tests.models:Configured", model="/a")
    assert a.startswith(catalogue.COMPUTED)
    assert _version("tests.models:Configured", model="/a") == a, "stable for the same options"
    assert _version("tests.models:Configured", model="/b") != a
    assert _version("tests.models:Configured", model="/a", layers="3") != a
    # a declared version gets the options' digest appended
    v = _version("tests.models:ConfiguredVersioned", model="/a")
    assert v.startswith("3+") and v != _version("tests.models:ConfiguredVersioned", model="/b")


def test_a_target_given_no_options_keeps_its_version() -> None:
    class Plain(mtq.Model):
        version = "5"

        def predict(self, batch: list[Any]) -> list[Any]:
            return batch

    assert catalogue.version_of(Plain()) == "5"
    f = load_model("tests.handlers:double")
    assert catalogue.version_of(f) == catalogue.version_of(load_model("tests.handlers:double"))


def test_the_record_holds_the_given_options_as_json() -> None:
    m = load_model("tests.models:Configured", options={"model": "/a", "normalize": "off"})
    rec = catalogue.model_record(m, "tests.models:Configured", "v")
    assert json.loads(rec["options"]) == {"model": "/a", "normalize": False}
    assert json.loads(catalogue.model_record(load_model("tests.handlers:double"),
                                             "tests.handlers:double", "v")["options"]) == {}
