"""Extract one version's ``openAPIV3Schema`` from a CustomResourceDefinition.

Usage: ``python extract.py CRD.yaml VERSION OUT.json`` (see README.md here for the
sources). ``description`` fields are dropped (they are most of the size and never
change what validates); everything else is kept as the CRD has it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml


def strip_descriptions(node: Any) -> Any:
    """``node`` without ``description`` keys in schema objects (recursively).

    A property *named* ``description`` (a key of ``properties``) is kept.
    """
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "properties" and isinstance(v, dict):
                out[k] = {name: strip_descriptions(s) for name, s in v.items()}
            elif k != "description":
                out[k] = strip_descriptions(v)
        return out
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def main(crd_path: str, version: str, out_path: str) -> None:
    """Write ``crd_path``'s schema for ``version`` to ``out_path`` as JSON."""
    crd = next(d for d in yaml.safe_load_all(Path(crd_path).read_text()) if d)
    spec = crd["spec"]
    ver = next(v for v in spec["versions"] if v["name"] == version)
    doc = {
        "group": spec["group"],
        "kind": spec["names"]["kind"],
        "version": version,
        "openAPIV3Schema": strip_descriptions(ver["schema"]["openAPIV3Schema"]),
    }
    Path(out_path).write_text(
        json.dumps(doc, indent=None, separators=(",", ":"), sort_keys=True) + "\n"
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
