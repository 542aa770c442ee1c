"""Docs that run, second half of the pages (a file of its own so that pytest-xdist's
``--dist loadfile`` runs the two halves on two workers); :mod:`tests.docs.snippets`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.snippets import needs_default, run_page, shard


@pytest.mark.parametrize("page", shard(1))
def test_page_runs(page: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    default = request.getfixturevalue("example_server") if needs_default(page) else None
    run_page(page, tmp_path, default)
