"""Drift of a tensor's values against a reference: the population stability index over
bins at the reference's quantiles, and the two-sample Kolmogorov-Smirnov test
(``scipy.stats.ks_2samp``). The reference is a ``.npz`` file beside config.pbtxt (one
array per tensor name) or the first N values after a version loads.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pdserve.observability.monitoring.spec import SpecError

#: A bin's share is floored at this in the PSI (an empty bin would make it infinite).
EPSILON = 1e-4
#: The KS test compares at most this many reference values (an even subsample).
KS_MAX = 5000
#: A reference needs at least this many values per bin.
MIN_PER_BIN = 5


class Reference:
    """The reference values of one tensor, binned at their quantiles.

    Raises (constructor):
        SpecError: fewer than ``MIN_PER_BIN * bins`` finite values, or all equal.
    """

    def __init__(self, values: np.ndarray, bins: int, what: str) -> None:
        flat = np.asarray(values, dtype=np.float64).reshape(-1)
        flat = flat[np.isfinite(flat)]
        if len(flat) < MIN_PER_BIN * bins:
            raise SpecError(
                f"{what}: {len(flat)} finite reference values; at least {MIN_PER_BIN * bins} "
                f"are needed for {bins} bins"
            )
        flat.sort()
        edges = np.unique(np.quantile(flat, np.linspace(0, 1, bins + 1))[1:-1])
        if len(edges) == 0 and flat[0] == flat[-1]:
            edges = np.asarray([flat[0]])  # a constant reference: at / above it
        self.edges = edges
        self.shares = _shares(flat, edges)
        step = max(1, len(flat) // KS_MAX)
        self.sample = flat[::step]
        self.count = len(flat)

    def psi(self, values: np.ndarray) -> float:
        """The population stability index of ``values`` against this reference:
        sum over bins of (q - p) * ln(q / p), p the reference's shares, q ``values``'."""
        q = _shares(values, self.edges)
        p = self.shares
        return float(np.sum((q - p) * np.log(q / p)))

    def ks(self, values: np.ndarray) -> tuple[float, float]:
        """The two-sample KS statistic and p-value of ``values`` against the reference."""
        from scipy.stats import ks_2samp

        r = ks_2samp(self.sample, values)
        return float(r.statistic), float(r.pvalue)


def _shares(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    counts = np.bincount(np.searchsorted(edges, values, side="right"), minlength=len(edges) + 1)
    return np.maximum(counts / max(1, len(values)), EPSILON)


def load_reference(path: Path, tensors: list[str], bins: int) -> dict[str, Reference]:
    """Read a reference file: an ``.npz`` holding one numeric array per tensor.

    Raises:
        SpecError: the file is missing or unreadable, lacks one of ``tensors``, holds a
            non-numeric array, or too few values (names the file and the tensor).
    """
    if not path.is_file():
        raise SpecError(f"drift: reference file {path.name} not found beside config.pbtxt")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except Exception as e:  # zip / npy errors
        raise SpecError(f"drift: reference file {path.name} is not a readable .npz: {e}") from None
    out = {}
    for name in tensors:
        if name not in arrays:
            raise SpecError(
                f"drift: reference file {path.name} has no array {name!r} "
                f"(it has {sorted(arrays) or 'none'})"
            )
        a = arrays[name]
        if a.dtype.kind not in "iuf":
            raise SpecError(f"drift: reference {path.name}[{name!r}] is {a.dtype}, not numeric")
        out[name] = Reference(a, bins, f"drift: reference {path.name}[{name!r}]")
    return out
