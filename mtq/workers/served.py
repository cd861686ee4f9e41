"""What a supervisor's processes serve: one target on one queue, or a host's engines
(``mtq workers start --config host.toml``), one per queue, each with its queue's
consumer; the model options later processes start with; and which engine a command
to the processes is about."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mtq.broker.config import SettingsSpec, to_wire
from mtq.broker.consumer import Consumer
from mtq.errors import ConfigError

#: commands about one engine: in a host, they go to the engine of the queue they came on
ROUTED = frozenset({"reload", "cancel", "load", "unload", "reset"})


class Served:
    """The engines of a supervisor's processes (a process of one worker has one)."""

    def __init__(self, target: str, queue: str, engines: Sequence[Mapping[str, Any]], *,
                 url: str | None, settings: SettingsSpec,
                 options: Mapping[str, str] | None = None) -> None:
        if bool(engines) == bool(target or queue):
            raise ConfigError("a supervisor serves a target and a queue, or a host's engines")
        #: a host: several engines per process, one per queue
        self.host = bool(engines)
        #: each engine as mtq.workers.hostfile.EngineSpec.to_dict gives it (one queue: its name)
        self.engines = [dict(e) for e in engines] or [{"queue": queue}]
        queues = [e["queue"] for e in self.engines]
        twice = sorted({q for q in queues if queues.count(q) > 1})
        if twice:
            raise ConfigError(f"one engine per queue: {twice} given twice")
        #: one per engine, in their order (the first is the single queue's)
        self.consumers = [Consumer(q, url, settings=settings) for q in queues]
        #: one queue: the model's options (--set KEY=VALUE, as text), for every process
        self.options = dict(options or {})
        #: queue -> the options of the last load or reload to every process, adopted
        #: once a process reports its engine loaded with them (adopt)
        self.asked: dict[str, dict[str, str]] = {}

    def wire(self) -> list[dict[str, Any]]:
        """A host's engines as a process is started with them (ChildConfig.engines);
        empty for one queue (the process is given target and queue)."""
        if not self.host:
            return []
        return [{**e, "settings": to_wire(c.broker.source)}
                for e, c in zip(self.engines, self.consumers)]

    def route(self, out: dict[str, Any], msg: Mapping[str, Any]) -> dict[str, Any]:
        """``out``, a command to the processes made from ``msg``: in a host, one about
        an engine (:data:`ROUTED`) names the queue it came on, so that only that
        queue's engine acts on it (mtq.workers.host.Host.command)."""
        if self.host and msg.get("queue") and out.get("cmd") in ROUTED:
            out["queue"] = msg["queue"]
        return out

    def ask(self, queue: str | None, options: Mapping[str, str]) -> None:
        """A load or reload with ``options`` was sent to every process (of ``queue``)."""
        self.asked[queue or self.engines[0]["queue"]] = dict(options)

    def adopt(self, i: int, options: Any) -> str | None:
        """Engine ``i`` of a process loaded its model with ``options`` (all of them, as
        text): if they hold the options a load or reload to every process asked for,
        the processes started from now on start with them; returns the line to log
        then, None otherwise (a reload narrowed to one worker changes no one else's)."""
        queue = self.engines[i]["queue"] if 0 <= i < len(self.engines) else ""
        asked = self.asked.get(queue)
        if not isinstance(options, dict) or asked is None:
            return None
        new = {str(k): str(v) for k, v in options.items()}
        served = dict(self.engines[i].get("options") or {}) if self.host else self.options
        if any(new.get(k) != v for k, v in asked.items()) or new == served:
            return None
        if self.host:
            self.engines[i]["options"] = new
        else:
            self.options = new
        given = " ".join(f"--set {k}={v}" for k, v in new.items()) or "no --set"
        of = f"queue {queue!r}'s engine " if self.host else ""
        return f"processes start {of}with {given} from now on"
