"""Targets for the host-file tests (``tests.host_models:<name>``), beside
``tests.models``' batched Probe: a plain function, so that one host process serves
a Model and a function, each in its engine. Imported in worker processes: no pytest."""

from __future__ import annotations

import os
from typing import Any


def shout(payload: Any) -> Any:
    """The payload's text in capitals, and the process that served it."""
    return {"text": str(payload.get("text", "")).upper(), "pid": os.getpid(),
            "worker": os.environ.get("MTQ_WORKER_ID")}
