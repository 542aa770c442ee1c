"""Print deploy/prometheus/pdserve-rules.yml wrapped in a Prometheus Operator
``PrometheusRule`` (``monitoring.coreos.com/v1``), so that the rules file stays the
single source (kustomize cannot turn a file into an object's spec).

    python3 deploy/kubernetes/prometheusrule.py --namespace pdserve | kubectl apply -f -

Needs PyYAML. ``--label KEY=VALUE`` (repeatable) adds labels, e.g. the one your
Prometheus' ``ruleSelector`` matches (kube-prometheus-stack: ``release=NAME``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

RULES = Path(__file__).resolve().parents[1] / "prometheus" / "pdserve-rules.yml"


def prometheus_rule(namespace: str | None, labels: dict[str, str]) -> dict[str, object]:
    """The PrometheusRule object; its ``spec`` is the rules file as is."""
    meta: dict[str, object] = {
        "name": "pdserve-rules",
        "labels": {"app.kubernetes.io/name": "pdserve", **labels},
    }
    if namespace:
        meta["namespace"] = namespace
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": meta,
        "spec": yaml.safe_load(RULES.read_text()),
    }


def main(argv: list[str] | None = None) -> int:
    """Write the PrometheusRule as YAML to stdout."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--namespace", help="metadata.namespace (default: none)")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    labels = dict(kv.split("=", 1) for kv in args.label)
    yaml.safe_dump(prometheus_rule(args.namespace, labels), sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
