"""pdserve.observability.monitoring.drift: PSI and KS are ~0 for the same distribution
and large for a shifted one; a bad reference file fails with the reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdserve.observability.monitoring.drift import Reference, load_reference
from pdserve.observability.monitoring.spec import SpecError


def test_psi_and_ks() -> None:
    rng = np.random.default_rng(0)
    ref = Reference(rng.normal(0, 1, 20000), 10, "t")
    assert len(ref.edges) == 9 and np.allclose(ref.shares, 0.1, atol=1e-3)
    same = rng.normal(0, 1, 5000)
    assert ref.psi(same) < 0.02
    stat, p = ref.ks(same)
    assert stat < 0.05 and p > 0.01
    shifted = rng.normal(1, 1, 5000)
    assert ref.psi(shifted) > 0.5
    stat, p = ref.ks(shifted)
    assert stat > 0.3 and p < 1e-6


def test_psi_by_hand() -> None:
    ref = Reference(np.repeat([0.0, 1.0], 50), 2, "t")  # edges [0.5]: shares .5 / .5
    q = np.array([0.0] * 90 + [1.0] * 10)
    expected = (0.9 - 0.5) * np.log(0.9 / 0.5) + (0.1 - 0.5) * np.log(0.1 / 0.5)
    assert ref.psi(q) == pytest.approx(expected)


def test_reference_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "ref.npz"
    with pytest.raises(SpecError, match="not found"):
        load_reference(path, ["OUT"], 10)
    path.write_bytes(b"not a zip")
    with pytest.raises(SpecError, match="not a readable .npz"):
        load_reference(path, ["OUT"], 10)
    np.savez(path, OTHER=np.zeros(100))
    with pytest.raises(SpecError, match="has no array 'OUT'"):
        load_reference(path, ["OUT"], 10)
    np.savez(path, OUT=np.array(["a"] * 100))
    with pytest.raises(SpecError, match="not numeric"):
        load_reference(path, ["OUT"], 10)
    np.savez(path, OUT=np.arange(20.0))
    with pytest.raises(SpecError, match="at least 50"):
        load_reference(path, ["OUT"], 10)
    np.savez(path, OUT=np.arange(200.0))
    assert load_reference(path, ["OUT"], 10)["OUT"].count == 200
