"""docs/cli.md lists every queue setting with its default and unit, as the code has
them (the table under "Queue settings")."""

from __future__ import annotations

import dataclasses
import re

from mtq.settings import QUEUE_SETTING_DOCS, QueueSettings
from tests.support.paths import ROOT


def test_every_queue_setting_is_documented_with_its_default_and_unit() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    section = text.split("## Queue settings", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): (m.group(2).replace(" ", ""), m.group(3))
            for m in re.finditer(r"^\| `(\w+)` \| ([^|]+?) \| ([^|]+?) \|", section, re.M)}
    defaults = dataclasses.asdict(QueueSettings())
    assert set(rows) == set(defaults) == set(QUEUE_SETTING_DOCS), set(rows) ^ set(defaults)
    for name, value in defaults.items():
        shown = ("true" if value else "false") if isinstance(value, bool) else \
            f"{value:g}" if isinstance(value, float) else str(value) or "(none)"
        assert rows[name] == (shown, QUEUE_SETTING_DOCS[name][0]), (name, rows[name])
