"""``pdserve rollback``: pin a model to an earlier version on a running server.

A small HTTP client of the KServe V2 repository extension (works against pdserve
or Triton in ``explicit`` model control mode; see :mod:`pdserve.repository.control`):

1. ``GET /v2/models/{m}/config``: the configuration being served (Triton's JSON form);
2. ``POST /v2/repository/models/{m}/load`` with that configuration, its
   ``version_policy`` replaced by ``specific { versions: [N] }``, as the ``config``
   parameter. The pinned version loads and warms up beside the serving one and
   traffic switches when it is ready; if it fails, nothing changes;
3. ``GET /v2/models/{m}``: the versions serving afterwards.

``--unpin`` posts a load without a configuration, so the server reads config.pbtxt
from disk again.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any

from pdserve.app.subcommands import Subparsers

#: Seconds to wait for one HTTP answer (a load may warm a big model up).
HTTP_TIMEOUT_SECS = 600

#: Where ``--url`` points by default (pdserve's and Triton's HTTP port on loopback).
DEFAULT_URL = "127.0.0.1:8000"


def _http(url: str, method: str = "GET", body: dict[str, object] | None = None) -> Any:
    """One JSON request; the decoded JSON answer (None when empty).

    Raises:
        RuntimeError: an HTTP error status (with the server's ``error`` text) or no
            connection.
    """
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_SECS) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            text = json.loads(text).get("error", text)
        except ValueError:
            pass
        raise RuntimeError(f"{method} {url}: HTTP {e.code}: {text}") from None
    except urllib.error.URLError as e:
        raise RuntimeError(f"{method} {url}: {e.reason}") from None
    return json.loads(raw) if raw.strip() else None


def rollback(url: str, model: str, version: int | None) -> list[str]:
    """Pin ``model`` to ``version`` (or, with ``None``, reload config.pbtxt from disk).

    Uses the repository API of a server in ``explicit`` mode: the served
    configuration with ``version_policy {specific {versions: [version]}}`` as a
    load override. The pinned version loads and warms up beside the serving one
    and traffic switches when it is ready; if it fails, nothing changes.

    Args:
        url: the server's HTTP address, ``host:port`` or ``http://host:port``.
        model: the model's name.
        version: the version folder to pin, or None to unpin.

    Returns:
        the versions serving afterwards (strings, as V2 model metadata lists them).

    Raises:
        RuntimeError: the server refused (not explicit mode, no such version...) or
            could not be reached.
    """
    base = url if "://" in url else f"http://{url}"
    base = base.rstrip("/")
    if version is None:
        _http(f"{base}/v2/repository/models/{model}/load", "POST", {})
    else:
        cfg = _http(f"{base}/v2/models/{model}/config")
        cfg["version_policy"] = {"specific": {"versions": [int(version)]}}
        _http(
            f"{base}/v2/repository/models/{model}/load",
            "POST",
            {"parameters": {"config": json.dumps(cfg)}},
        )
    meta = _http(f"{base}/v2/models/{model}")
    return list(meta.get("versions", []))


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """Add ``pdserve rollback`` to the CLI's subcommands; its defaults set ``run``."""
    p = sub.add_parser(
        "rollback",
        help="pin a model to an earlier version (explicit model control mode)",
        description="Pin MODEL to VERSION on a running pdserve (or Triton) in explicit model "
        "control mode, through the repository API: the served configuration is loaded "
        "again with version_policy specific [VERSION]. The version loads and warms up "
        "beside the serving one; traffic switches when it is ready. --unpin reloads "
        "config.pbtxt from disk.",
    )
    p.add_argument("model", help="model name")
    p.add_argument("version", nargs="?", type=int, help="version to pin (a version folder)")
    p.add_argument("--unpin", action="store_true", help="go back to config.pbtxt's policy")
    p.add_argument(
        "--url", default=DEFAULT_URL, help="server HTTP address (host:port; default %(default)s)"
    )
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``pdserve rollback``; the process exit code.

    Returns:
        0 done (the serving versions are printed); 1 the server refused or could not
        be reached (the reason is printed); 2 neither or both of VERSION and ``--unpin``.
    """
    if (args.version is None) == (not args.unpin):
        print("pdserve rollback: give exactly one of VERSION or --unpin")
        return 2
    try:
        versions = rollback(args.url, args.model, None if args.unpin else args.version)
    except RuntimeError as e:
        print(f"pdserve rollback: {e}")
        return 1
    print(f"{args.model}: serving versions {', '.join(versions) or '(none)'}")
    return 0
