"""mtq.rq.jobs.check_storable: the type walk that spares a second JSON encoding of each
result agrees with json.dumps (what RQ's JSON serializer runs) on what can be stored."""

from __future__ import annotations

import datetime as dt
import decimal
import json
from typing import Any

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st
from rq.job import Job
from rq.serializers import JSONSerializer

from mtq.rq.jobs import ResultNotStorable, _plain_json, check_storable

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30)


def dumps_ok(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


@given(JSON)
def test_the_walk_accepts_only_what_json_stores(value: Any) -> None:
    assert _plain_json(value) and dumps_ok(value)


@pytest.mark.parametrize("value", [b"bytes", {1, 2}, dt.date(2026, 1, 1), decimal.Decimal(1),
                                   [object()], {"k": {"deep": b"x"}}, {(1, 2): "tuple key"}])
def test_anything_else_is_left_to_the_encoder(value: Any) -> None:
    assert not _plain_json(value)
    job = Job(connection=redis.Redis(), serializer=JSONSerializer)  # never connects
    if dumps_ok(value):
        check_storable(job, value)
    else:
        with pytest.raises(ResultNotStorable, match="cannot be stored with JSON serializer"):
            check_storable(job, value)


def test_keys_json_would_convert_are_checked_by_encoding() -> None:
    job = Job(connection=redis.Redis(), serializer=JSONSerializer)  # never connects
    assert not _plain_json({1: "int key"})
    check_storable(job, {1: "int key"})  # json.dumps turns the key into "1": storable
