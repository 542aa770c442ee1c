"""The reference pages under docs/reference/ are generated from the code
(docs/gen_reference.py): a committed page that differs from what the code gives fails,
naming the command that rewrites it."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIX = "python docs/gen_reference.py"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs/gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    return _generator()


@pytest.fixture(scope="module")
def rendered(gen: ModuleType) -> dict[str, str]:
    return gen.render_all()


def test_committed_reference_pages_are_current(gen: ModuleType, rendered: dict[str, str]) -> None:
    stale = gen.stale_pages(rendered)
    assert not stale, f"stale reference pages {stale}: run `{FIX}` and commit the result"


def test_a_stale_page_is_reported(
    gen: ModuleType, rendered: dict[str, str], tmp_path: Path
) -> None:
    for name in rendered:
        shutil.copy(ROOT / "docs/reference" / name, tmp_path / name)
    (tmp_path / "metrics.md").write_text(rendered["metrics.md"].replace("counter", "gauge", 1))
    (tmp_path / "http-routes.md").unlink()
    assert gen.stale_pages(rendered, tmp_path) == [
        "docs/reference/metrics.md",
        "docs/reference/http-routes.md",
    ]
    assert gen.FIX == FIX


def test_pages_hold_what_the_code_defines(rendered: dict[str, str]) -> None:
    cli = rendered["cli.md"]
    for sub in ("serve", "rollback", "check", "perf", "analyze", "top"):
        assert f"## pdserve {sub}\n" in cli
    assert "`--model-control-mode {none,poll,explicit,on_demand}`" in cli
    assert "`--http-port HTTP_PORT`" in cli
    metrics = rendered["metrics.md"]
    assert "| `nv_inference_request_failure` | counter | `model`, `reason`, `version` |" in metrics
    assert "| `pdserve_request_duration_seconds` | histogram | `model`, `version` |" in metrics
    assert "| `pdserve_circuit_transitions_total` | counter | `model`, `to`, `version` |" in metrics
    routes = rendered["http-routes.md"]
    assert "| `POST` | `/v2/models/{model_name}/infer` |" in routes
    assert "| `GET` | `/v2/health/ready` |" in routes


def test_model_config_page_is_generated_where_the_field_table_exists(gen: ModuleType) -> None:
    """docs/reference/model-config.md comes from pdserve.config.reference_page (the
    ModelConfig field table) where that module exists; until then it is written by hand."""
    if importlib.util.find_spec("pdserve.config.reference_page") is None:
        pytest.skip("no pdserve.config.reference_page: model-config.md is written by hand")
    assert "model-config.md" in gen.PAGES
