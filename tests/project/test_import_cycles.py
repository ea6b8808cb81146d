"""No module imports itself back, through any chain, function-level imports included.

import-linter's contracts (``make lint``) keep the layers one-way and siblings acyclic; a package
and its own submodules (``kernels/__init__`` and ``kernels/page_scores``) are neither siblings nor
layers, so this checks every module against every other.
"""
from __future__ import annotations

import pytest

grimp = pytest.importorskip("grimp")

PACKAGES = ("cli", "bench", "api", "app", "rocketkv_mt", "tiers")


def test_no_module_is_in_an_import_cycle():
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    cycles = sorted(
        (importer, imported)
        for importer in graph.modules
        for imported in graph.find_modules_directly_imported_by(importer)
        if graph.chain_exists(importer=imported, imported=importer)
    )
    assert not cycles, cycles
