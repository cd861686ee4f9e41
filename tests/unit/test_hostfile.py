"""The host file (mtq.workers.hostfile): every mistake a named error that names its
file and line, and the line finder it uses (mtq.workers.tomllines). No Redis; the
targets are tests.models' (found, and for options imported, in this process)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

from mtq.errors import ConfigError, HostFileError
from mtq.workers import devices, hostfile
from mtq.workers.hostfile import EngineSpec, parse, parse_size
from mtq.workers.tomllines import key_lines, line_of

PROBE = 'target = "tests.models:Probe"'


def fails(text: str, line: int | None, *fragments: str) -> str:
    """``text`` is refused with a HostFileError at ``line`` (None: no line), whose
    message holds every fragment."""
    with pytest.raises(HostFileError) as info:
        parse(text, "host.toml")
    msg = str(info.value)
    prefix = "host.toml: " if line is None else f"host.toml:{line}: "
    assert msg.startswith(prefix), msg
    for f in fragments:
        assert f in msg, msg
    return msg


# -- a good file ---------------------------------------------------------------------
GOOD = f"""\
# two models in one process
[host]
devices = "cpu"
replicas = 2
memory_budget = "12GiB"
max_loaded = 2
standby = 0
lease_ms = 30000

[[engine]]
queue = "embed"
target = "tests.models:Configured"
options = {{ model = "/srv/minilm", layers = 3, scale = 0.5, normalize = false }}
max_batch_size = 64
max_wait_ms = 5
timeout = 30
memory = "500MiB"

[[engine]]
queue = "chat"
{PROBE}
on_demand = true
idle_unload_s = 600
memory = 1000
"""


def test_a_good_file_reads_into_its_spec() -> None:
    spec = parse(GOOD, "host.toml")
    assert (spec.devices, spec.replicas, spec.memory_budget, spec.max_loaded, spec.standby,
            spec.lease_ms) == ("cpu", 2, 12 * 2**30, 2, 0, 30000)
    embed, chat = spec.engines
    assert embed == EngineSpec(
        queue="embed", target="tests.models:Configured",
        options={"model": "/srv/minilm", "layers": "3", "scale": "0.5", "normalize": "false"},
        max_batch_size=64, max_wait_ms=5.0, timeout_s=30.0, memory_bytes=500 * 2**20, line=10)
    assert (chat.on_demand, chat.idle_unload_s, chat.memory_bytes, chat.line) == \
        (True, 600.0, 1000, 19)
    assert embed.to_dict() == {
        "queue": "embed", "target": "tests.models:Configured", "options": embed.options,
        "overrides": {"max_batch_size": 64, "max_wait_ms": 5.0, "timeout_s": 30.0},
        "on_demand": False, "idle_unload_s": None, "memory": 500 * 2**20}
    assert chat.to_dict()["overrides"] == {}


def test_host_table_is_optional_and_its_defaults_are_the_flags() -> None:
    spec = parse(f'[[engine]]\nqueue = "a"\n{PROBE}\n')
    assert (spec.devices, spec.replicas, spec.memory_budget, spec.max_loaded, spec.standby,
            spec.lease_ms) == ("cpu", 1, None, None, None, None)


def test_devices_as_a_list_and_all() -> None:
    body = f'[[engine]]\nqueue = "a"\n{PROBE}\n'
    assert parse(f'[host]\ndevices = ["cpu"]\n{body}').devices == "cpu"
    n = devices.cuda_count()
    want = ",".join(f"cuda:{i}" for i in range(n)) if n else "cpu"
    assert parse(f'[host]\ndevices = "all"\n{body}').devices == want


def test_load_reads_the_file_and_names_it(tmp_path: Path) -> None:
    path = tmp_path / "h.toml"
    path.write_text(GOOD)
    assert hostfile.load(str(path)).engines[0].queue == "embed"
    path.write_text(GOOD.replace("qu" + 'eue = "chat"', 'qeue = "chat"'))
    with pytest.raises(HostFileError, match=re.escape(f"{path}:20: unknown key 'qeue'")):
        hostfile.load(str(path))


def test_a_missing_or_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(HostFileError, match=r"nope\.toml: cannot read the host file: No such"):
        hostfile.load(str(tmp_path / "nope.toml"))
    bad = tmp_path / "latin.toml"
    bad.write_bytes(b'[host]\n# caf\xe9\n')
    with pytest.raises(HostFileError, match=re.escape(f"{bad}:2: not UTF-8")):
        hostfile.load(str(bad))


def test_host_file_error_is_a_config_error() -> None:
    assert issubclass(HostFileError, ConfigError)


# -- every mistake, with its line ------------------------------------------------------
def test_toml_syntax_error_gives_tomllib_line_and_column() -> None:
    fails('[host]\nreplicas = 1\ndevices = "cpu\n', 3, "TOML syntax error at column",
          "Illegal character")
    fails("[host\n", 1, "TOML syntax error")
    fails("[host]\nreplicas = 1\nreplicas = 2\n", 3, "Cannot overwrite a value")


@pytest.mark.parametrize("text, line, fragments", [
    # unknown keys: top level, [host], [[engine]] n, with a suggestion
    ("hosts = 1\n", 1, ("unknown key 'hosts' at the top level (did you mean 'host'?)",
                        "known keys: host, engine")),
    ("[host]\ndevice = 'cpu'\n", 2, ("unknown key 'device' in [host] (did you mean "
                                     "'devices'?)",)),
    (f"[[engine]]\nqueue = 'a'\n{PROBE}\n\n[[engine]]\n{PROBE}\nqeue = 'b'\n", 7,
     ("unknown key 'qeue' in [[engine]] 2 (did you mean 'queue'?); known keys: queue, "
      "target, options",)),
    ("[[engine]]\nqueue = 'a'\n" + PROBE + "\n[engine.extra]\nk = 1\n", 4,
     ("unknown key 'extra' in [[engine]] 1",)),
    # missing queue or target: the engine's header line
    ("[host]\n\n[[engine]]\ntarget = 'tests.models:Probe'\n", 3,
     ("[[engine]] 1 has no queue",)),
    ("[[engine]]\nqueue = 'a'\n", 1, ("[[engine]] 1 has no target",)),
    # no engine at all; engine as a table
    ("[host]\nreplicas = 1\n", None, ("no [[engine]] table",)),
    ("[engine]\nqueue = 'a'\n", 1, ("engine must be an array of tables",)),
    ("[host]\nx = 1\n[[engine]]\n", 2, ("unknown key 'x'",)),
    # types and ranges
    ("[host]\nreplicas = 1.5\n", 2, ("replicas must be an integer 0..256, got a number (1.5)",)),
    ("[host]\nreplicas = 300\n", 2, ("replicas must be an integer 0..256",)),
    ("[host]\nreplicas = true\n", 2, ("replicas must be an integer", "a boolean")),
    ("[host]\nstandby = 2\n", 2, ("standby must be an integer 0..1",)),
    ("[host]\nlease_ms = 10\n", 2, ("lease_ms must be an integer >= 100",)),
    ("[host]\nmax_loaded = 0\n", 2, ("max_loaded must be an integer >= 1",)),
    ("[host]\nmemory_budget = '12 parsecs'\n", 2, ("memory_budget: '12 parsecs' is not a size",)),
    ("[host]\nmemory_budget = 1.5e9\n", 2, ("is not a size",)),
    ("[host]\nmemory_budget = 0\n", 2, ("memory_budget must be at least 1 byte",)),
    ("[host]\ndevices = 3\n", 2, ("devices must be a string",)),
    ("host = 'cpu'\n", 1, ("host must be a table",)),
    (f"[[engine]]\nqueue = 'a'\n{PROBE}\nmax_batch_size = 0\n", 4,
     ("max_batch_size must be an integer 1..100000",)),
    (f"[[engine]]\nqueue = 'a'\n{PROBE}\nmax_wait_ms = -1\n", 4,
     ("max_wait_ms must be a number in 0..60000",)),
    (f"[[engine]]\nqueue = 'a'\n{PROBE}\ntimeout = 0\n", 4, ("timeout must be a number >= 0.001",)),
    (f"[[engine]]\nqueue = 'a'\n{PROBE}\ntimeout = inf\n", 4, ("timeout must be a number",)),
    (f"[[engine]]\nqueue = 'a'\n{PROBE}\non_demand = 'yes'\n", 4,
     ("on_demand must be true or false, got a string ('yes')",)),
    (f"[[engine]]\nqueue = 'a'\n{PROBE}\nidle_unload_s = 0\n", 4,
     ("idle_unload_s must be a number > 0",)),
    (f"[[engine]]\nqueue = 'a'\n{PROBE}\nmemory = 'lots'\n", 4, ("memory: 'lots' is not a size",)),
    (f"[[engine]]\nqueue = 7\n{PROBE}\n", 2, ("queue must be a non-empty string",)),
    ("[[engine]]\nqueue = 'a'\ntarget = ''\n", 3, ("target must be a non-empty string",)),
    # options: a table of scalars, each on its own line when written as a table
    (f"[[engine]]\nqueue = 'a'\n{PROBE}\noptions = 'model=x'\n", 4, ("options must be a table",)),
    (f"[[engine]]\nqueue = 'a'\n{PROBE}\n[engine.options]\nok = 1\nk = [1]\n", 6,
     ("option 'k' must be a string, a number or true/false, got an array",)),
    (f"[[engine]]\nqueue = 'a'\n{PROBE}\noptions = {{ ok = 1, deep = {{ x = 1 }} }}\n", 4,
     ("option 'deep'", "got a table")),
    # queue names
    (f"[[engine]]\nqueue = 'a b'\n{PROBE}\n", 2, ("invalid queue name 'a b'",)),
    (f"[[engine]]\nqueue = 'a{{x}}'\n{PROBE}\n", 2, ("invalid queue name",)),
    # the same queue twice: the second, naming the first
    (f"[[engine]]\nqueue = 'a'\n{PROBE}\n[[engine]]\nqueue = 'b'\n{PROBE}\n"
     f"[[engine]]\n{PROBE}\nqueue = 'a'\n", 9,
     ("queue 'a' is served twice: [[engine]] 1 (line 1) serves it already",)),
    # devices
    ("[host]\ndevices = 'gpu'\n", 2, ("bad device 'gpu' in devices 'gpu'",)),
    ("[host]\ndevices = 'cuda:x'\n", 2, ("bad device 'cuda:x'",)),
    ("[host]\ndevices = ''\n", 2, ("bad device",)),
    # targets: a module that cannot be found, options it does not take or lacks
    ("[[engine]]\nqueue = 'a'\ntarget = 'tests.no_such_module:X'\n", 3,
     ("cannot import 'tests.no_such_module'",)),
    ("[[engine]]\nqueue = 'a'\ntarget = 'no-colon'\n", 3, ("bad target 'no-colon'",)),
    ("[[engine]]\nqueue = 'a'\ntarget = 'tests.models:Configured'\n"
     "options = { model = 'm', poolin = 'cls' }\n", 4,
     ("has no option 'poolin' (did you mean 'pooling'?)",)),
    ("[[engine]]\nqueue = 'a'\ntarget = 'tests.models:Configured'\n"
     "[engine.options]\nmodel = 'm'\nlayers = 99\n", 4, ("option 'layers' must be",)),
    ("[[engine]]\nqueue = 'a'\ntarget = 'tests.models:Configured'\noptions = { layers = 2 }\n",
     4, ("option 'model' is required: give it in the engine's options: model=VALUE",)),
    ("[[engine]]\nqueue = 'a'\ntarget = 'tests.models:NoSuchClass'\noptions = { x = 1 }\n",
     3, ("has no attribute 'NoSuchClass'",)),
    (f"[[engine]]\nqueue = 'a'\n{PROBE}\noptions = {{ x = 1 }}\n", 4, ("has no option 'x'",)),
    # budgets the engines loaded at start already pass
    (f"[host]\nmax_loaded = 1\n[[engine]]\nqueue = 'a'\n{PROBE}\n[[engine]]\nqueue = 'b'\n"
     f"{PROBE}\n", 2, ("max_loaded = 1, but 2 engines load at start (a, b)",)),
    (f"[host]\nmemory_budget = '1GB'\n[[engine]]\nqueue = 'a'\n{PROBE}\nmemory = '2GB'\n", 6,
     ("queue 'a': memory = 2000000000 bytes is more than the host's memory_budget",)),
    (f"[host]\nmemory_budget = '1GB'\n[[engine]]\nqueue = 'a'\n{PROBE}\nmemory = '600MB'\n"
     f"[[engine]]\nqueue = 'b'\n{PROBE}\nmemory = '600MB'\n", 2,
     ("the engines that load at start need 1200000000",)),
])
def test_each_mistake_names_its_line(text: str, line: int | None,
                                     fragments: tuple[str, ...]) -> None:
    fails(text, line, *fragments)


def test_on_demand_engines_are_outside_the_start_budget() -> None:
    text = (f"[host]\nmax_loaded = 1\nmemory_budget = '1GB'\n"
            f"[[engine]]\nqueue = 'a'\n{PROBE}\nmemory = '600MB'\n"
            f"[[engine]]\nqueue = 'b'\n{PROBE}\nmemory = '600MB'\non_demand = true\n")
    assert [e.on_demand for e in parse(text).engines] == [False, True]


def test_a_device_this_machine_does_not_have() -> None:
    n = devices.cuda_count()
    msg = fails(f"[host]\n\ndevices = 'cpu,cuda:{n}'\n", 3, f"device cuda:{n} does not exist")
    assert ("no CUDA device" in msg) if n == 0 else (f"{n} CUDA device(s)" in msg), msg


def test_the_first_mistake_wins_and_nothing_after_it_is_read() -> None:
    # the unknown key comes first; the missing module below it is not imported
    fails("[host]\nreplikas = 2\n[[engine]]\nqueue = 'a'\ntarget = 'tests.no_such:X'\n", 2,
          "unknown key 'replikas'")


# -- sizes -----------------------------------------------------------------------------
@pytest.mark.parametrize("value, want", [
    (12, 12), ("12", 12), ("12B", 12), ("1KB", 1000), ("1 KiB", 1024), ("1.5GiB", 3 * 2**29),
    ("2gb", 2 * 10**9), ("500MiB", 500 * 2**20), ("1TiB", 2**40), (".5KiB", 512),
])
def test_parse_size(value: object, want: int) -> None:
    assert parse_size(value) == want


@pytest.mark.parametrize("value", ["", "GiB", "12 GiBs", "-1GiB", "1e9", True, 1.5, None])
def test_parse_size_refuses(value: object) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(value)


# -- the line finder ----------------------------------------------------------------------
TRICKY = '''\
# a comment with [[engine]] in it
[host]
devices = "cpu"  # [[engine]]
note = """
[[engine]]
queue = "not a key" \\"""
"""
raw = \'\'\'
[[engine]]\'\'\'

[[engine]]
queue = "a"
"target" = 'm:x'
options = { model = "/srv", "n.b" = 2, sub = { deep = true } }

[[ engine ]]
queue = "b"
options.model = "x"
arr = [
  1, # ]
  {q = 2},
]
"key \\" quoted" = 1
[engine.extra]
k = 1
[[engine.items]]
z = 1
[[engine.items]]
z = 2
'''


def test_key_lines_follow_headers_dotted_keys_inline_tables_and_skip_strings() -> None:
    doc = tomllib.loads(TRICKY)  # valid TOML, as key_lines expects
    assert len(doc["engine"]) == 2 and doc["host"]["note"].startswith("[[engine]]")
    lines = key_lines(TRICKY)
    want = {
        ("host",): 2, ("host", "devices"): 3, ("host", "note"): 4, ("host", "raw"): 8,
        ("engine",): 11, ("engine", 0): 11, ("engine", 0, "queue"): 12,
        ("engine", 0, "target"): 13, ("engine", 0, "options"): 14,
        ("engine", 0, "options", "n.b"): 14, ("engine", 0, "options", "sub", "deep"): 14,
        ("engine", 1): 16, ("engine", 1, "queue"): 17, ("engine", 1, "options"): 18,
        ("engine", 1, "options", "model"): 18, ("engine", 1, "arr"): 19,
        ("engine", 1, "arr", 1, "q"): 21, ("engine", 1, 'key " quoted'): 23,
        ("engine", 1, "extra"): 24, ("engine", 1, "extra", "k"): 25,
        ("engine", 1, "items", 0, "z"): 27, ("engine", 1, "items", 1, "z"): 29,
    }
    assert {k: lines.get(k) for k in want} == want
    # every key tomllib read has a line
    def paths(value: object, path: tuple) -> list[tuple]:
        if isinstance(value, dict):
            return [p for k, v in value.items() for p in [(*path, k), *paths(v, (*path, k))]]
        if isinstance(value, list):
            return [p for i, v in enumerate(value) for p in paths(v, (*path, i))]
        return []
    assert all(p in lines for p in paths(doc, ()) if not isinstance(p[-1], int)), \
        [p for p in paths(doc, ()) if p not in lines]


def test_line_of_falls_back_to_the_enclosing_table() -> None:
    lines = key_lines("[host]\nx = 1\n[[engine]]\nqueue = 'a'\n")
    assert line_of(lines, ("engine", 0, "target")) == 3
    assert line_of(lines, ("host", "x")) == 2
    assert line_of(lines, ("nothing",)) == 0


# -- the files the docs show -----------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_docs_example_and_examples_host_toml_are_good_files() -> None:
    text = (ROOT / "docs" / "workers.md").read_text()
    block = re.search(r"^## The host file\n.*?^```toml\n(.*?)^```", text, re.S | re.M)
    assert block, "docs/workers.md: the host file section has no ```toml example"
    # (its GPU is this machine's only if it has one)
    spec = parse(block.group(1).replace('devices = "cuda:0"', 'devices = "cpu"'), "doc")
    assert [e.queue for e in spec.engines] == ["embed", "chat"]
    assert spec.engines[1].options == {"model": "/srv/qwen", "default_max_tokens": "256"}
    example = hostfile.load(str(ROOT / "examples" / "host.toml"))
    assert [(e.queue, e.on_demand) for e in example.engines] == \
        [("classify", False), ("classify-wide", True)]


def test_an_empty_engine_array_names_its_line() -> None:
    # (it passed the check, and the supervisor refused it without a file or line)
    fails('engine = []\n[host]\nreplicas = 1\n', 1, "engine is empty", "[[engine]]")

