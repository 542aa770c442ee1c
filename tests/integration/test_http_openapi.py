"""The OpenAPI document (pdserve/frontends/http/openapi.json, served at GET
/v2/openapi.json) and schemathesis against a live pdserve: every operation with
schema-valid and schema-violating requests, with no 5xx and no crash.

Checks: schemathesis's defaults but ``positive_data_acceptance`` (a schema-valid
inference request is still refused when it does not fit the model: 400 is right), with
``negative_data_rejection`` accepting any 4xx (a JSON part over the limit is 413).
``not_a_server_error`` fails on any 5xx. Half of the examples aim at the real model
(``tiny``, version 2; the example generator ``text_generator`` for the OpenAI routes)
instead of a generated name, so that inference, metadata, config, statistics, load,
unload and completions run their real paths. Examples are bounded and derandomized:
the run takes seconds and is the same every time.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import schemathesis
import tritonclient.http as httpclient
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance
from schemathesis.config._checks import NegativeDataRejectionConfig

from pdserve.frontends.http.routes import openapi_document
from tests.conftest import ROOT, ServerProcess, copy_models, start_server

#: Examples per operation and generation mode (28 operations, 10 with negative examples
#: too); PDSERVE_FUZZ_EXAMPLES=300 for a longer run (about 90 s).
MAX_EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "25"))

STATUSES: Counter[int] = Counter()

#: The example generator, which the OpenAI completion routes serve.
GENERATOR = ROOT / "examples" / "generator_repository" / "text_generator"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root: Path = tmp_path_factory.mktemp("openapi")
    repo = copy_models(root / "repo", "tiny")
    shutil.copytree(GENERATOR, repo / "text_generator")
    proc = start_server(
        repo,
        root / "pdserve.log",
        "--model-control-mode=explicit",
        "--load-model=tiny",
        "--load-model=text_generator",
        "--http-body-timeout-secs=5",
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def api_schema(server: ServerProcess) -> Any:
    schema = schemathesis.openapi.from_url(f"http://{server.http_url}/v2/openapi.json")
    schema.config.base_url = f"http://{server.http_url}"
    schema.config.checks.negative_data_rejection = NegativeDataRejectionConfig(
        expected_statuses=["4XX"]
    )
    return schema


def test_fuzz_the_http_api(api_schema: Any) -> None:
    """Each operation, schema-valid then schema-violating requests.

    (schemathesis's pytest plugin does not run on this pytest; the operations'
    strategies are driven with hypothesis directly, which is what the plugin does.)
    """
    operations = [result.ok() for result in api_schema.get_all_operations()]
    doc = json.loads(openapi_document())
    documented = {f"{m.upper()} {path}" for path, ms in doc["paths"].items() for m in ms}
    # schemathesis leaves out the operation that serves the schema it was loaded from.
    assert {op.label for op in operations} == documented - {"GET /v2/openapi.json"}
    # Schema-violating requests exist only where there is more than a path string:
    # a body or a typed header.
    negative = {
        f"{m.upper()} {path}"
        for path, ms in doc["paths"].items()
        for m, spec in ms.items()
        if "requestBody" in spec or any(p["in"] != "path" for p in spec.get("parameters", []))
    }
    failures: list[str] = []
    for operation in operations:
        modes = [GenerationMode.POSITIVE]
        if operation.label in negative:
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:

            @given(case=operation.as_strategy(generation_mode=mode), real_model=st.booleans())
            @settings(
                max_examples=MAX_EXAMPLES,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def run(case: Any, real_model: bool) -> None:
                if real_model:
                    if "model_name" in case.path_parameters:
                        case.path_parameters["model_name"] = "tiny"
                    if "model_version" in case.path_parameters:
                        case.path_parameters["model_version"] = "2"
                    # the OpenAI routes: the example generator, by path or in the body
                    if "model" in case.path_parameters:
                        case.path_parameters["model"] = "text_generator"
                    if isinstance(case.body, dict) and "model" in case.body:
                        case.body["model"] = "text_generator"
                response = case.call_and_validate(excluded_checks=[positive_data_acceptance])
                STATUSES[response.status_code] += 1

            try:
                run()
            except Exception as exc:  # noqa: BLE001 - report every operation's failure
                failures.append(f"{operation.label} ({mode.value}): {exc}")
    assert not failures, "\n\n".join(failures)


def test_the_server_survived_the_fuzzing(server: ServerProcess) -> None:
    """Runs after the fuzzing (same module, in order): the process is alive, logged no
    unhandled exception, and still serves a real inference."""
    assert server.proc.poll() is None
    log = server.log()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    client = httpclient.InferenceServerClient(server.http_url)
    if not client.is_model_ready("tiny"):  # the fuzzing may have unloaded it
        client.load_model("tiny")
    x = np.ones((1, 64), dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(x)
    assert client.infer("tiny", [inp]).as_numpy("OUTPUT0").shape == (1, 64)
    total = sum(STATUSES.values())
    print(f"schemathesis: {total} requests, statuses {dict(sorted(STATUSES.items()))}")
    assert total == 0 or all(code < 500 for code in STATUSES)


def test_the_document_is_served_and_names_every_route(server: ServerProcess) -> None:
    import urllib.request

    with urllib.request.urlopen(f"http://{server.http_url}/v2/openapi.json", timeout=10) as r:
        assert r.status == 200 and r.headers["content-type"] == "application/json"
        served = r.read()
    assert served == openapi_document()
    doc = json.loads(served)
    assert doc["openapi"].startswith("3.")
    assert set(doc["paths"]) == {
        "/v2",
        "/v2/openapi.json",
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/stats",
        "/v2/models/{model_name}",
        "/v2/models/{model_name}/versions/{model_version}",
        *(
            f"/v2/models/{{model_name}}{version}/{action}"
            for version in ("", "/versions/{model_version}")
            for action in ("ready", "config", "stats", "infer")
        ),
        "/v2/models/{model_name}/traffic",
        "/v2/models/{model_name}/rollout",
        "/v2/repository/index",
        "/v2/repository/models/{model_name}/load",
        "/v2/repository/models/{model_name}/unload",
        "/v2/logging",
        "/v2/trace/setting",
        "/v2/models/{model_name}/trace/setting",
        "/v1/models",
        "/v1/models/{model}",
        "/v1/embeddings",
        "/v1/completions",
        "/v1/chat/completions",
    }
