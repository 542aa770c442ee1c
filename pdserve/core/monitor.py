"""The server's model-monitoring hook, as the core sees it (the implementation is
:class:`pdserve.observability.monitoring.monitor.Monitor`, set by the app).

A version whose configuration asks for monitoring gets a :class:`VersionObserver` when
it loads (a malformed setting fails the load); the server calls its ``observe`` once
per finished request, with the outputs or the error. ``observe`` never blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from pdserve.core.types import InferRequest


class VersionObserver(Protocol):
    """Watches one model version's requests."""

    def observe(
        self,
        request: InferRequest,
        outputs: dict[str, np.ndarray] | None,
        error: BaseException | None,
    ) -> None:
        """One finished request: its outputs (success) or its error (failure)."""
        ...


class ResponseMonitor(Protocol):
    """Gives loaded versions their observer."""

    def attach(self, mv: Any, model_dir: Path) -> VersionObserver | None:
        """The observer of a freshly loaded version (None: nothing monitored).

        Raises:
            ValueError: its monitoring settings are invalid (the load fails).
        """
        ...
