"""mtq.broker.codes: every code a Lua script returns maps to an exception of the
mtq.errors tree, with the context its message needs; an unknown code is refused
clearly. No Redis. (That the enum mirrors lua/_lib.lua: test_lua_contract.py.)"""

from __future__ import annotations

import pytest

import mtq
from mtq.broker import codes
from mtq.broker.codes import Code
from mtq.errors import (
    BrokerError,
    DuplicateTask,
    InvalidArgument,
    LeaseLost,
    MtqError,
    QueueFull,
    RateLimited,
    TaskFinished,
    TaskNotFound,
    WouldMissDeadline,
)


def test_every_code_maps_to_an_mtq_error() -> None:
    for code in Code:
        exc = codes.error(code, queue="q", task_id="t1", task_ids=["t1"], status="failed",
                          waiting=5, max_length=5, adding=2, detail="bad")
        assert isinstance(exc, MtqError), f"{code.name} maps to {type(exc).__name__}"
        assert type(exc) is not MtqError and type(exc) is not BrokerError, code.name
        assert str(exc), f"{code.name}'s exception has no message"


def test_each_code_maps_to_its_class() -> None:
    expected = {
        Code.QUEUE_FULL: QueueFull,
        Code.DUPLICATE_ID: DuplicateTask,
        Code.LEASE_LOST: LeaseLost,
        Code.NOT_FOUND: TaskNotFound,
        Code.FINISHED: TaskFinished,
        Code.BAD_ARGUMENT: InvalidArgument,
        Code.RATE_LIMITED: RateLimited,
        Code.WOULD_MISS: WouldMissDeadline,
    }
    assert set(expected) == set(Code)
    for code, cls in expected.items():
        assert type(codes.error(code)) is cls
        assert type(codes.error(int(code))) is cls, "a plain int from a reply maps too"


def test_messages_carry_the_context() -> None:
    full = codes.error(Code.QUEUE_FULL, queue="embed", waiting=10, max_length=10, adding=3)
    assert isinstance(full, QueueFull) and full.waiting == 10 and full.max_length == 10
    assert "'embed'" in str(full) and "3 more" in str(full) and full.created == []

    dup = codes.error(Code.DUPLICATE_ID, queue="embed", task_ids=["a", "b"])
    assert isinstance(dup, DuplicateTask) and dup.duplicates == ["a", "b"] and dup.created == []
    assert "'a', 'b'" in str(dup) and "'embed'" in str(dup)

    lost = codes.error(Code.LEASE_LOST, task_ids=["x", "y"])
    assert isinstance(lost, LeaseLost) and lost.task_ids == ["x", "y"]
    assert codes.error(Code.LEASE_LOST, task_id="z").task_ids == ["z"]

    missing = codes.error(Code.NOT_FOUND, queue="embed", task_id="abc")
    assert isinstance(missing, TaskNotFound) and isinstance(missing, LookupError)
    assert str(missing) == ("no task abc in queue 'embed' (wrong id or queue, or its "
                            "retention time ran out)")

    done = codes.error(Code.FINISHED, task_id="abc", status="succeeded")
    assert isinstance(done, TaskFinished) and done.status == "succeeded" and "abc" in str(done)

    bad = codes.error(Code.BAD_ARGUMENT, detail="unknown dead-letter action 'x': use retry "
                      "or purge")
    assert isinstance(bad, ValueError), "dlq raised a ValueError before: it still is one"
    assert str(bad) == "unknown dead-letter action 'x': use retry or purge"
    assert "refused" in str(codes.error(Code.BAD_ARGUMENT, queue="q"))


@pytest.mark.parametrize("code", [-9, -100, 0, 1, 2, 99])
def test_an_unknown_code_raises_a_clear_error(code: int) -> None:
    with pytest.raises(BrokerError, match=rf"answered {code}, which is not one of mtq's codes "
                       r"\(QUEUE_FULL -1, .*WOULD_MISS -8\)"):
        codes.error(code, queue="q")


def test_new_classes_are_reachable_from_the_package() -> None:
    assert mtq.TaskFinished is TaskFinished
    assert mtq.InvalidArgument is InvalidArgument
    assert "TaskFinished" not in mtq.__all__ and "InvalidArgument" not in mtq.__all__
