"""pdserve.core.monitor: the monitoring protocols the server calls; the observability
implementation satisfies them (checked by mypy at this call, and at run time here)."""

from __future__ import annotations

from pathlib import Path

from pdserve.core.monitor import ResponseMonitor, VersionObserver
from pdserve.observability.monitoring.monitor import Monitor, VersionMonitor


def test_monitor_implements_the_protocols(tmp_path: Path) -> None:
    monitor: ResponseMonitor = Monitor()
    observer_type: type[VersionObserver] = VersionMonitor
    assert callable(monitor.attach) and callable(observer_type.observe)
    assert set(VersionObserver.__dict__) >= {"observe"} and set(ResponseMonitor.__dict__) >= {
        "attach"
    }
