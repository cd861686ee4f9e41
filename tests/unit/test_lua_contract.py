"""Static checks on the Lua scripts: contract headers, error codes, key hygiene, loading."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

import mtq.broker
from mtq.broker import scripts
from mtq.broker.codes import Code, is_error

LUA_DIR = Path(mtq.broker.__file__).parent / "lua"
SCRIPT_FILES = sorted(p for p in LUA_DIR.glob("*.lua") if p.name != "_lib.lua")
LIB = LUA_DIR / "_lib.lua"


def _contract(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    end = text.find("]]")
    assert end > 0, f"{path.name}: no closing ]] for the contract block"
    return text[:end]


def _strip_comments(source: str) -> str:
    """Lua source without block comments (--[[ ]]) and line comments (--)."""
    source = re.sub(r"--\[(=*)\[.*?\]\1\]", "", source, flags=re.S)
    return re.sub(r"--[^\n]*", "", source)


def test_script_files_exist():
    assert SCRIPT_FILES, f"no Lua scripts in {LUA_DIR}"
    assert LIB.is_file()


@pytest.mark.parametrize("path", SCRIPT_FILES, ids=lambda p: p.name)
def test_script_opens_with_contract_block(path):
    text = path.read_text(encoding="utf-8")
    assert text.startswith(f"--[[ {path.name}"), (
        f"{path.name} must open with '--[[ {path.name} -- what it does'")
    block = _contract(path)
    for word in ("KEYS", "ARGV", "Returns"):
        assert word in block, f"{path.name}'s contract block does not mention {word}"


@pytest.mark.parametrize("path", SCRIPT_FILES, ids=lambda p: p.name)
def test_script_includes_lib(path):
    lines = path.read_text(encoding="utf-8").splitlines()
    assert "--@include _lib.lua" in lines


def test_names_match_files():
    assert sorted(scripts.NAMES) == sorted(p.stem for p in SCRIPT_FILES)
    assert len(set(scripts.NAMES)) == len(scripts.NAMES)


def _lua_error_constants() -> dict[str, int]:
    source = _strip_comments(LIB.read_text(encoding="utf-8"))
    m = re.search(r"local\s+(E_\w+(?:\s*,\s*E_\w+)*)\s*=\s*(-?\d+(?:\s*,\s*-?\d+)*)", source)
    assert m, "no 'local E_..., ... = ...' declaration in _lib.lua"
    names = [n.strip() for n in m.group(1).split(",")]
    values = [int(v) for v in m.group(2).split(",")]
    assert len(names) == len(values), "E_* names and values do not pair up"
    found = dict(zip(names, values))
    # no other E_ constant assigned elsewhere
    others = set(re.findall(r"local\s+(E_\w+)\s*=", source)) - set(found)
    assert not others, f"E_* constants declared outside the main declaration: {others}"
    return found


def test_lua_error_codes_equal_code_enum():
    lua = _lua_error_constants()
    py = {f"E_{c.name}": c.value for c in Code}
    assert lua == py


def test_code_values_are_negative_and_unique():
    values = [c.value for c in Code]
    assert all(v < 0 for v in values)
    assert len(set(values)) == len(values)
    assert all(is_error(int(c)) for c in Code)
    assert not is_error(0) and not is_error(1) and not is_error("-1")


@pytest.mark.parametrize("path", SCRIPT_FILES, ids=lambda p: p.name)
def test_scripts_use_only_defined_error_constants(path):
    used = set(re.findall(r"\bE_[A-Z_]+\b", _strip_comments(path.read_text(encoding="utf-8"))))
    assert used <= set(_lua_error_constants()), f"undefined: {used - set(_lua_error_constants())}"


@pytest.mark.parametrize("path", [*SCRIPT_FILES, LIB], ids=lambda p: p.name)
def test_no_hardcoded_mtq_keys(path):
    code = _strip_comments(path.read_text(encoding="utf-8"))
    literals = re.findall(r"""(['"])(mtq[^'"]*)\1""", code)
    assert not literals, f"{path.name} builds names from literals: {[lit for _, lit in literals]}"
    # and no redis.call whose first argument after the command is a string literal
    for cmd, _quote in re.findall(r"""redis\.call\(\s*['"](\w+)['"]\s*,\s*(['"])""", code):
        pytest.fail(f"{path.name}: redis.call('{cmd}', <literal key>) -- keys must come "
                    "through KEYS")


@pytest.mark.parametrize("path", [*SCRIPT_FILES, LIB], ids=lambda p: p.name)
def test_no_keys_beyond_the_documented_twenty_two(path):
    code = _strip_comments(path.read_text(encoding="utf-8"))
    indexes = {int(i) for i in re.findall(r"KEYS\[(\d+)\]", code)}
    assert indexes <= set(range(1, 23)), f"{path.name} uses KEYS{sorted(indexes)}"


@pytest.mark.parametrize("name", scripts.NAMES)
def test_script_loads_with_include_expanded(name):
    s = scripts.script(name)
    assert s.name == name
    assert not [ln for ln in s.source.splitlines() if ln.startswith("--@include")]
    assert "LEASE_MARK" not in s.source or "local LEASE_MARK" in s.source
    assert f"--[[ {name}.lua" in s.source
    assert s.sha == hashlib.sha1(s.source.encode()).hexdigest()
    assert scripts.script(name) is s  # cached


def _lib_names() -> set[str]:
    """Every name _lib.lua defines at its top level (parsed independently of the loader)."""
    code = _strip_comments(LIB.read_text(encoding="utf-8"))
    names = set(re.findall(r"^local\s+function\s+(\w+)", code, flags=re.M))
    names |= set(re.findall(r"^function\s+(\w+)", code, flags=re.M))
    for group in re.findall(r"^local\s+(\w+(?:\s*,\s*\w+)*)", code, flags=re.M):
        names |= {n.strip() for n in group.split(",")} - {"function"}
    return names


@pytest.mark.parametrize("name", scripts.NAMES)
def test_script_gets_every_library_name_it_reaches(name):
    # The loader pastes in only the library statements a script can reach (scripts.py,
    # _shaken): a name it left out would be a nil global, an error only on the path
    # that calls it. Every library name the pasted source mentions must be defined in it.
    source = _strip_comments(scripts.script(name).source)
    defined = set(re.findall(r"^local\s+function\s+(\w+)", source, flags=re.M))
    defined |= set(re.findall(r"^function\s+(\w+)", source, flags=re.M))
    for group in re.findall(r"^local\s+(\w+(?:\s*,\s*\w+)*)", source, flags=re.M):
        defined |= {n.strip() for n in group.split(",")}
    mentioned = set(re.findall(r"[A-Za-z_]\w*", source)) & _lib_names()
    assert mentioned <= defined, f"{name}.lua reaches {sorted(mentioned - defined)} undefined"


def test_scripts_get_only_what_they_reach():
    # extend.lua renews leases: it needs none of the task life-cycle helpers
    source = scripts.script("extend").source
    assert "local function finish(" not in source
    assert "local function now_ms()" in source
    # claim reaps expired leases, which may dead-letter a task: all of that is there
    claim = scripts.script("claim").source
    for fn in ("reap_expired", "reclaim", "dead_letter", "finish", "flush_replies"):
        assert f"local function {fn}(" in claim


def test_unknown_script_name_raises():
    with pytest.raises(KeyError, match="nope"):
        scripts.script("nope")
