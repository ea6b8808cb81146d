"""README's settings tables say what the settings classes say: every variable, every default.

A reader configures the server from these tables, so a default that drifts (the README once gave
``RKV_KERNEL_SIZE`` as 63 when the code said 15) is a bug. Rules: the Engine table lists exactly
``Settings``' fields; the Serving table lists only ``ServeSettings``' fields, and with the Security
table it lists all of them; in every table a default given as a literal (`` `15` ``) equals the
field's default, and a field whose default is None may be described in words (``–``, ``model's``).
"""
from __future__ import annotations

import re
from pathlib import Path

from app.settings import ServeSettings, ServerSettings, Settings

README = Path(__file__).resolve().parents[2] / "README.md"
VARIABLE = re.compile(r"`RKV_([A-Z0-9_]+)`")
LITERAL = re.compile(r"`([^`]*)`")


def tables() -> dict[str, list[tuple[list[str], str]]]:
    """Each ``| variable | default | meaning |`` table by its title (the heading or ``...:`` line before it),
    as (fields, default cell) rows."""
    found: dict[str, list[tuple[list[str], str]]] = {}
    lines = README.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("| variable | default |"):
            continue
        title = next(t for t in reversed(lines[:i]) if t.startswith("#") or t.endswith(":"))
        rows = found.setdefault(title, [])
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            cells = [c.strip() for c in row.strip("|").split("|")]
            rows.append(([name.lower() for name in VARIABLE.findall(cells[0])], cells[1]))
    return found


def table(title_part: str) -> list[tuple[list[str], str]]:
    return next(rows for title, rows in tables().items() if title_part in title)


def shown(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, Path):
        return str(value).replace(str(Path.home()), "~", 1)
    return str(value)


def names(rows) -> set[str]:
    return {name for fields, _ in rows for name in fields}


def test_the_engine_table_lists_exactly_the_engine_settings():
    assert names(table("(`Settings`)")) == set(Settings.model_fields)


def test_the_serving_tables_list_exactly_the_serving_settings():
    serving = names(table("(`ServeSettings`)"))
    assert serving <= set(ServeSettings.model_fields), sorted(serving - set(ServeSettings.model_fields))
    everywhere = serving | names(table("## Security and limits"))
    assert set(ServeSettings.model_fields) <= everywhere, sorted(set(ServeSettings.model_fields) - everywhere)


def test_every_default_in_every_table_is_the_code_default():
    fields = ServerSettings.model_fields
    checked = 0
    for title, rows in tables().items():
        for names_, cell in rows:
            parts = [cell] if len(names_) == 1 else re.split(r" / |, ", cell)
            assert len(parts) == len(names_), (title, names_, cell)
            for name, part in zip(names_, parts):
                assert name in fields, f"{title}: RKV_{name.upper()} is not a setting"
                default = fields[name].default
                literal = LITERAL.search(part)
                if default is None:
                    continue  # described in words: unset, derived, the model's
                assert literal is not None, f"{title}: RKV_{name.upper()}'s default should be `{shown(default)}`"
                assert literal.group(1) == shown(default), f"{title}: RKV_{name.upper()} = {part!r}, code: {default!r}"
                checked += 1
    assert checked >= 40


def test_every_default_as_the_tables_write_it_reads_back_from_the_environment(monkeypatch):
    # A reader sets these variables as the tables spell them (RKV_SKETCH_BITS=4 is a string, where
    # the field is one of the numbers 0, 2, 4): each must parse to the default it stands for.
    fields = ServerSettings.model_fields
    checked = 0
    for rows in tables().values():
        for names_, cell in rows:
            parts = [cell] if len(names_) == 1 else re.split(r" / |, ", cell)
            for name, part in zip(names_, parts):
                literal = LITERAL.search(part)
                if fields[name].default is None or literal is None:
                    continue
                monkeypatch.setenv(f"RKV_{name.upper()}", literal.group(1).replace("~", str(Path.home()), 1))
                assert getattr(ServerSettings(), name) == fields[name].default, name
                monkeypatch.delenv(f"RKV_{name.upper()}")
                checked += 1
    assert checked >= 40
    monkeypatch.setenv("RKV_SKETCH_BITS", "2")
    assert Settings().sketch_bits == 2
