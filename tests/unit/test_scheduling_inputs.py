"""The pure parts of scheduling (no Redis): the cost estimate, the checks of priority,
tenant, cost and weights, what a task is encoded with, the settings, and the cost a
worker reports."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import redis

import mtq
from mtq.broker.config import SettingsSource
from mtq.broker.protocol import _costs
from mtq.client.submit import estimate_cost, new_task
from mtq.errors import ConfigError, InvalidArgument, InvalidName
from mtq.settings import QueueSettings, format_weights, parse_weights
from mtq.validation import MAX_COST, check_cost, check_priority, check_tenant
from mtq.workers import engine, outcomes


@pytest.mark.parametrize("payload,cost", [
    ({"prompt": "abc", "max_tokens": 10}, 13.0),
    ({"prompt": "héllo", "max_tokens": 0}, 6.0),            # UTF-8 bytes
    ({"prompt": "\U0001f600", "max_tokens": 1}, 5.0),       # 4 bytes
    ({"prompt": [5, 6, 7], "max_tokens": 2}, 5.0),          # token ids: one each
    ({"prompt": (5, 6), "max_tokens": 2}, 4.0),
    ({"messages": [{"role": "system", "content": "ab"}, {"role": "user", "content": "cde"}],
      "max_tokens": 4}, 9.0),
    ({"messages": [{"role": "user"}], "max_tokens": 4}, 4.0),  # no content: 0
    ({"max_tokens": 7}, 7.0),                                # no prompt
    ({"prompt": 12, "max_tokens": 7}, 7.0),                  # not text nor a list
    ({"prompt": "ab", "messages": [{"content": "xyz"}], "max_tokens": 1}, 3.0),  # prompt first
])
def test_estimate_cost_is_the_prompt_plus_max_tokens(payload: Any, cost: float) -> None:
    assert estimate_cost(payload) == cost


@pytest.mark.parametrize("payload", [
    {"prompt": "abc"}, {"prompt": "abc", "max_tokens": 2.0}, {"max_tokens": True},
    {"max_tokens": -1}, {"max_tokens": "10"}, [1, 2], "text", None, 3,
])
def test_estimate_cost_is_none_without_an_integer_max_tokens(payload: Any) -> None:
    assert estimate_cost(payload) is None


def task(settings: QueueSettings | None = None, payload: Any = None, **kw: Any) -> Any:
    return new_task(settings or QueueSettings(), {"x": 1} if payload is None else payload,
                    None, None, None, None, None, **kw)


def test_new_task_encodes_band_tenant_and_cost() -> None:
    t = task(priority="interactive", tenant="acme", cost=12)
    assert (t.band, t.tenant, t.cost) == ("i", "acme", 12.0) and isinstance(t.cost, float)
    t = task()
    assert (t.band, t.tenant, t.cost) == ("s", "", None), "no cost field: the script's 1"
    assert task(priority="batch").band == "b" and task(priority="standard").band == "s"


def test_new_task_cost_is_given_else_estimated_else_the_queue_default() -> None:
    gen = {"prompt": "ab", "max_tokens": 3}
    assert task(payload=gen).cost == 5.0
    assert task(payload=gen, cost=0).cost == 0.0, "a given cost wins, 0 included"
    dear = QueueSettings(default_cost=9)
    assert task(dear).cost == 9.0
    assert task(dear, payload=gen).cost == 5.0, "the estimate wins over the default"
    assert task(dear, cost=2.5).cost == 2.5


@pytest.mark.parametrize("kw,error", [
    ({"priority": "urgent"}, InvalidArgument), ({"priority": ""}, InvalidArgument),
    ({"priority": "i"}, InvalidArgument), ({"cost": -0.5}, InvalidArgument),
    ({"cost": math.nan}, InvalidArgument), ({"cost": -math.inf}, InvalidArgument),
    ({"cost": "3"}, InvalidArgument), ({"cost": MAX_COST * 2}, InvalidArgument),
    ({"tenant": "a/b"}, InvalidName), ({"tenant": "é"}, InvalidName),
    ({"tenant": 7}, InvalidName), ({"tenant": "_x"}, InvalidName),
])
def test_new_task_refuses_bad_scheduling_arguments(kw: dict[str, Any],
                                                   error: type[Exception]) -> None:
    with pytest.raises(error):
        task(**kw)


def test_the_checks_accept_their_bounds() -> None:
    assert check_priority(None) == "s"
    assert [check_priority(p) for p in ("interactive", "standard", "batch")] == ["i", "s", "b"]
    for name in ("a", "A9", "team-7", "x.y@z+w_v", "9" * 64):
        assert check_tenant(name) == name
    for bad in ("", "x" * 65, "a b", "a:b", "a,b", "a=b", "-a", ".a"):
        with pytest.raises(InvalidName):
            check_tenant(bad)
    assert check_cost(0) == 0.0 and check_cost(MAX_COST) == MAX_COST
    with pytest.raises(InvalidArgument):
        check_cost(0, zero=False)
    with pytest.raises(InvalidArgument):
        check_cost(MAX_COST * 1.01)


def test_tenant_weights_text_and_mapping() -> None:
    assert parse_weights("") == {}
    assert parse_weights(" acme=3, beta=0.5 ,") == {"acme": 3.0, "beta": 0.5}
    assert format_weights({"b": 0.5, "a": 3}) == "a=3,b=0.5"
    s = QueueSettings(tenant_weights={"acme": 3, "beta": 0.25})
    assert s.tenant_weights == "acme=3,beta=0.25" and s.weights == {"acme": 3.0, "beta": 0.25}
    assert QueueSettings().weights == {}


@pytest.mark.parametrize("bad", [
    "a=0", "a=-1", "a=nan", "a=inf", "a=", "=2", "a", "a b=1", "a=1e13", "a=two",
    {"a": 0}, {"a": -1.0}, {"a": math.nan}, {"a b": 1}, {"a": "x"}, 5,
])
def test_bad_tenant_weights_raise_config_error(bad: Any) -> None:
    with pytest.raises(ConfigError):
        QueueSettings(tenant_weights=bad)


@pytest.mark.parametrize("kw", [
    {"band_min_share": -1}, {"band_min_share": 100}, {"band_min_share": 5.0},
    {"band_min_share": True}, {"default_cost": math.nan}, {"default_cost": -1.0},
    {"default_cost": math.inf}, {"default_cost": "1"}, {"default_cost": True},
])
def test_bad_scheduling_settings_raise_config_error(kw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        QueueSettings(**kw)
    with pytest.raises(ConfigError):
        QueueSettings().replace(**kw)


def test_scheduling_settings_bounds_and_defaults() -> None:
    s = QueueSettings()
    assert (s.tenant_weights, s.default_cost, s.band_min_share) == ("", 1.0, 5)
    assert QueueSettings(band_min_share=0).band_min_share == 0
    assert QueueSettings(band_min_share=99).band_min_share == 99
    assert QueueSettings(default_cost=3).default_cost == 3.0
    assert QueueSettings(default_cost=0.0).default_cost == 0.0


def test_a_queue_s_overrides_may_give_tenant_weights_as_a_mapping() -> None:
    """Used to raise TypeError: the mapping went into the key of the shared sources."""
    client = redis.Redis(port=1)  # never connected: a source reads Redis only when asked
    a = SettingsSource.shared(client, "q", {"tenant_weights": {"a": 2}})
    b = SettingsSource.shared(client, "q", {"tenant_weights": "a=2"})
    assert a is b
    assert SettingsSource.shared(client, "q", {"tenant_weights": {"a": 3}}) is not a
    with pytest.raises(ConfigError):
        SettingsSource.shared(client, "q", {"tenant_weights": {"a": 0}})


def test_reported_costs_are_sent_by_their_place_in_the_call() -> None:
    assert _costs(["x", "y", "z"], {"x": 30.0, "z": 2.5}) == "1=30.0,3=2.5"
    assert _costs(["x"], {"other": 1.0}) == ""
    for bad in (math.nan, -1.0, math.inf, 2e12, "3"):
        with pytest.raises(InvalidArgument):
            _costs(["x"], {"x": bad})


def test_a_model_s_bad_cost_report_keeps_the_estimate(caplog: pytest.LogCaptureFixture) -> None:
    assert outcomes._cost(12) == 12.0 and outcomes._cost(0) == 0.0
    with caplog.at_level(logging.WARNING, logger="mtq.workers.worker"):
        for bad in (math.nan, -1, math.inf, "7", None):
            assert outcomes._cost(bad) is None
    assert caplog.text.count("keeps its estimate") == 5
    assert mtq.Costed("v", cost=3).value == "v"


def test_a_generation_s_cost_is_its_prompt_and_its_generated_tokens() -> None:
    class G:
        prompt_tokens = 11
        tokens = [1, 2, 3]

    assert engine._cost(G()) == 14.0  # type: ignore[arg-type]
    G.prompt_tokens = -20  # a model's mistake: the estimate stands, the settle goes on
    assert engine._cost(G()) is None  # type: ignore[arg-type]
