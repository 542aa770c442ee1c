"""``--instance-hang-timeout`` and ``--server-timing``: defaults and checks."""

from __future__ import annotations

import pytest

from pdserve.app.health_flags import HealthFlags
from pdserve.app.settings import Settings, SettingsError


def test_defaults() -> None:
    flags = HealthFlags()
    assert flags.instance_hang_timeout == 300.0
    assert flags.server_timing is False


def test_negative_bound_is_refused() -> None:
    with pytest.raises(SettingsError, match="--instance-hang-timeout"):
        Settings(instance_hang_timeout=-1.0).validate()
