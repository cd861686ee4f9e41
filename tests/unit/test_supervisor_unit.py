"""The supervisor's book of what each child holds (mtq.workers.supervisor)."""

from __future__ import annotations

from mtq.workers.children import drop as _drop


def test_a_settle_read_after_the_task_was_held_again_leaves_the_new_lease() -> None:
    held = {"a": "t2", "b": "t1"}  # "a" settled under t1, then claimed again under t2
    _drop(held, [["a", "t1"], ["b", "t1"], ["c", "t9"]])
    assert held == {"a": "t2"}
    _drop(held, [["a", "t2"]])
    assert held == {}
