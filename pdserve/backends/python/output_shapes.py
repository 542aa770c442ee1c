"""A python model's outputs whose shape differs from their configuration.

Triton's python backend sends each output tensor with the shape ``execute`` gave it,
whatever the configuration's ``dims`` say. pdserve does the same by default: the
response carries the produced shape, the first mismatch of each output of a loaded
version logs one warning (model, version, output, configured dims, produced shape),
and every mismatch counts in ``pdserve_output_shape_mismatch_total{model,version,
output}``. The model configuration parameter ``strict_output_shapes`` (``"true"``)
makes such an output fail its request with ``INTERNAL`` instead (the scheduler's
output check). Datatypes are always checked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdserve import config as cfgmod
from pdserve.core.stats import ModelStats

log = logging.getLogger("pdserve.python")

#: The model configuration parameter that turns the tolerance off.
STRICT_PARAMETER = "strict_output_shapes"

#: Told of one tolerated output: (output name, configured shape with the batch
#: dimension as ``-1`` when the model batches, produced shape).
MismatchHook = Callable[[str, list[int], tuple[int, ...]], None]

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off", ""})


def strict_output_shapes(config: cfgmod.ModelConfig, where: str = cfgmod.CONFIG_FILENAME) -> bool:
    """The model's ``strict_output_shapes`` parameter (default False); ``where``: the
    configuration file errors name.

    Raises:
        cfgmod.ConfigError: the value is not a boolean (``true``/``false``, ``1``/``0``,
            ``yes``/``no``, ``on``/``off``; any case).
    """
    value = (cfgmod.get_parameter(config, STRICT_PARAMETER, "") or "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise cfgmod.ConfigError(
        where,
        f"parameters.{STRICT_PARAMETER}",
        f"must be true or false, not {value!r}",
    )


class ShapeTolerance:
    """Counts and reports (once per output) the outputs served with the shape the
    model produced; the scheduler's output check calls it instead of failing them.

    Args:
        stats: the version's statistics (``output_shape_mismatches``, the counter).
    """

    def __init__(self, stats: ModelStats) -> None:
        self.stats = stats
        self._warned: set[str] = set()

    def __call__(self, output: str, expected: list[int], produced: tuple[int, ...]) -> None:
        counts = self.stats.output_shape_mismatches
        counts[output] = counts.get(output, 0) + 1
        if output in self._warned:
            return
        self._warned.add(output)
        log.warning(
            "python model '%s' version %s returned output '%s' with shape %s, but its "
            "configuration says %s; the response carries the shape the model produced, "
            "as Triton's python backend does (counted in "
            'pdserve_output_shape_mismatch_total; the model parameter %s: "true" '
            "makes it an error). Further mismatches of this output are only counted.",
            self.stats.name,
            self.stats.version,
            output,
            _shape(produced),
            _shape(expected),
            STRICT_PARAMETER,
        )


def tolerance(
    config: cfgmod.ModelConfig, stats: ModelStats, where: str = cfgmod.CONFIG_FILENAME
) -> MismatchHook | None:
    """The hook for a python model's output check: None when the model asks for
    strict shapes (a mismatch then fails the request).

    Raises:
        cfgmod.ConfigError: ``strict_output_shapes`` is not a boolean.
    """
    return None if strict_output_shapes(config, where) else ShapeTolerance(stats)


def _shape(dims: list[int] | tuple[int, ...]) -> str:
    return "[" + ",".join(str(int(d)) for d in dims) + "]"
