"""Where a pdserve process logs: stderr (or ``--log-file``), as the subcommand's flags say."""

from __future__ import annotations

import logging
import sys

from pdserve.app.settings import Settings
from pdserve.observability import logs


def setup_logging(verbose: int) -> None:
    """Log to stderr: INFO, or DEBUG with ``verbose`` > 0 (every subcommand but serve)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose > 0 else logging.INFO,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def setup_serve_logging(settings: Settings) -> None:
    """Log to stderr, or to ``--log-file`` (appended, a line at a time), as the
    ``--log-*`` flags say (:mod:`pdserve.observability.logs`): levels, format, and
    request/trace ids on the lines of a request.

    Raises:
        OSError: the log file cannot be opened for appending.
    """
    stream = None
    if settings.log_file is not None:
        stream = open(settings.log_file, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - process-long
    logs.configure(
        logs.state_from_flags(
            info=settings.log_info,
            warning=settings.log_warning,
            error=settings.log_error,
            verbose=settings.log_verbose,
            fmt=settings.log_format,
        ),
        stream,
        "" if settings.log_file is None else str(settings.log_file),
    )
