"""The cache modes are named in one registry (``rocketkv_mt.cache.CACHE_MODES``); the settings'
literal and the README's mode table list exactly those names."""
import re
from pathlib import Path
from typing import get_args

from app.settings import CacheMode, Settings
from rocketkv_mt.cache import CACHE_MODES

README = Path(__file__).resolve().parents[2] / "README.md"


def test_settings_accept_exactly_the_registered_modes():
    assert set(get_args(CacheMode)) == set(CACHE_MODES)
    assert Settings().mode in CACHE_MODES


def test_the_readme_mode_table_lists_every_registered_mode_once():
    text = README.read_text()
    table = text[text.index("## Cache modes"):]
    table = table[: table.index("\n\n", table.index("| mode |"))]
    rows = re.findall(r"^\| `([a-z-]+)`", table, flags=re.M)
    assert sorted(rows) == sorted(CACHE_MODES)
