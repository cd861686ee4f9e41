"""The task commands, one module per family: :mod:`mtq.cli.submit` (``mtq submit``),
:mod:`mtq.cli.status` (``status``, ``task``), :mod:`mtq.cli.cancel` (``cancel``,
``purge``) and :mod:`mtq.cli.dlq` (``dlq``).

This module is kept for code that imports the commands from here.
"""

from __future__ import annotations

from mtq.cli.cancel import cancel, purge
from mtq.cli.dlq import dlq
from mtq.cli.status import STATUS_COLUMNS, STATUS_LEGEND, compact_count, status, status_table, task
from mtq.cli.submit import FILE_CHUNK, submit

COMMANDS = (submit, status, task, cancel, dlq, purge)

__all__ = ["COMMANDS", "FILE_CHUNK", "STATUS_COLUMNS", "STATUS_LEGEND", "cancel", "compact_count",
           "dlq", "purge", "status", "status_table", "submit", "task"]
