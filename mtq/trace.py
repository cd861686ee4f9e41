"""``mtq trace``'s reading and conversion; it lives in :mod:`mtq.observe.perfetto`.

This path is kept for code that imports it.
"""

from mtq.observe.perfetto import (
    CHUNK,
    PAGE,
    QUEUE_PID,
    TERMINAL,
    chrome_trace,
    collect,
    in_window,
    parse_line,
    parse_record,
    parse_since,
    queue_exists,
    task_segments,
)

__all__ = ["CHUNK", "PAGE", "QUEUE_PID", "TERMINAL", "chrome_trace", "collect", "in_window",
           "parse_line", "parse_record", "parse_since", "queue_exists", "task_segments"]
