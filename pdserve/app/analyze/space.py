"""The search space of ``pdserve analyze``: which configurations of a model (or of
an ensemble's steps) can be tried, and how one becomes a ``config.pbtxt``.

A configuration sets four *knobs* per model (:class:`Knobs`): the instance count,
``max_batch_size``, ``dynamic_batching.preferred_batch_size`` and
``dynamic_batching.max_queue_delay_microseconds`` (``None``: no dynamic batching).
The space is a lattice: each :class:`Dimension` is one knob of one model (or of
several, see :func:`build_space`) with an ordered list of values, and a point is one
index per dimension. Points that configure the same thing are one configuration
(:meth:`Space.knobs` canonicalizes): without dynamic batching the batching knobs are
the shipped ones; a preferred size equal to ``max_batch_size`` is no preferred size;
a point whose preferred sizes exceed its ``max_batch_size`` is invalid. The search
orders that walk it are in :mod:`.search`. Pure functions and data only (no I/O).
"""

from __future__ import annotations

import copy
import difflib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.config import ENSEMBLE_PLATFORM, ModelConfig

#: What a value of the ``delay_us`` knob is when dynamic batching is off.
OFF = "off"

#: Default lattice values (``build_space`` adds the shipped value to each).
DEFAULT_QUEUE_DELAYS_US: tuple[int | None, ...] = (None, 0, 500, 2000)
DEFAULT_STEP_QUEUE_DELAYS_US: tuple[int | None, ...] = (None, 0, 1000)
DEFAULT_PREFERRED: tuple[str, ...] = ("none", "pow2")
#: model_analyzer tries 1 to 5 instances (``run_config_search_max_instance_count``).
MAX_DEFAULT_INSTANCES = 5


@dataclass(frozen=True)
class Knobs:
    """What ``pdserve analyze`` sets in one model's configuration.

    Attributes:
        instances: model instances in all (the count of its single instance group).
        max_batch_size: rows per batch (0: the model does not batch; never changed).
        preferred: ``dynamic_batching.preferred_batch_size``, ascending; ``()`` for
            none (the batcher then aims at ``max_batch_size``).
        delay_us: ``dynamic_batching.max_queue_delay_microseconds``; ``None`` when
            the configuration has no ``dynamic_batching``.
    """

    instances: int
    max_batch_size: int
    preferred: tuple[int, ...] = ()
    delay_us: int | None = None

    @property
    def batching(self) -> bool:
        """Whether dynamic batching is on."""
        return self.delay_us is not None

    def describe(self) -> str:
        """``2 inst, batch 32, delay 500us, preferred 8+16`` / ``1 inst, no batching``."""
        text = f"{self.instances} inst"
        if not self.batching:
            return text + (", no batching" if self.max_batch_size > 0 else "")
        text += f", batch {self.max_batch_size}, delay {self.delay_us}us"
        if self.preferred:
            text += ", preferred " + "+".join(str(p) for p in self.preferred)
        return text

    def as_dict(self) -> dict[str, object]:
        """Plain JSON values (``delay_us`` None = no dynamic batching)."""
        return {
            "instances": self.instances,
            "max_batch_size": self.max_batch_size,
            "preferred": list(self.preferred),
            "delay_us": self.delay_us,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Knobs:
        """Inverse of :meth:`as_dict`."""
        delay = d.get("delay_us")
        return cls(
            instances=int(d["instances"]),
            max_batch_size=int(d["max_batch_size"]),
            preferred=tuple(int(p) for p in d.get("preferred", ())),
            delay_us=None if delay is None else int(delay),
        )


#: One configuration of every model tuned: model name -> its knobs.
Point = dict[str, Knobs]


#: A configuration's hashable identity (:func:`point_key`).
PointKey = tuple[tuple[str, Knobs], ...]


def point_key(point: Mapping[str, Knobs]) -> PointKey:
    """A hashable identity of a configuration (models in name order)."""
    return tuple(sorted(point.items()))


def describe_point(point: Mapping[str, Knobs]) -> str:
    """One line: ``2 inst, batch 32, delay 0us`` (one model) or
    ``preprocess: 1 inst, no batching; efficientnet_lite0: ...`` (several)."""
    if len(point) == 1:
        return next(iter(point.values())).describe()
    return "; ".join(f"{m}: {k.describe()}" for m, k in point.items())


def shipped_knobs(cfg: ModelConfig) -> Knobs:
    """The knobs of a *complete* configuration (Triton's defaults applied, as
    ``GET /v2/models/{m}/config`` returns it): instance counts summed over groups,
    a preferred size list equal to ``[max_batch_size]`` read as none."""
    instances = sum(max(1, g.count) for g in cfg.instance_group) or 1
    delay: int | None = None
    preferred: tuple[int, ...] = ()
    if cfg.HasField("dynamic_batching"):
        db = cfg.dynamic_batching
        delay = int(db.max_queue_delay_microseconds)
        preferred = canonical_preferred(tuple(db.preferred_batch_size), cfg.max_batch_size) or ()
    return Knobs(instances, int(cfg.max_batch_size), preferred, delay)


def canonical_preferred(sizes: Sequence[int], max_batch_size: int) -> tuple[int, ...] | None:
    """Sorted distinct preferred sizes; ``()`` when they amount to none (empty, or
    only ``max_batch_size``); None when one is < 1 or > ``max_batch_size``."""
    out = tuple(sorted({int(s) for s in sizes}))
    if any(s < 1 or s > max_batch_size for s in out):
        return None
    return () if out in ((), (max_batch_size,)) else out


def resolve_preferred(token: str, max_batch_size: int) -> tuple[int, ...] | None:
    """A ``--preferred-batch-sizes`` token at ``max_batch_size`` -> the canonical
    sizes (:func:`canonical_preferred`), None when it does not fit.

    Tokens: ``none``; ``pow2`` (1, 2, 4, ... below ``max_batch_size``, and
    ``max_batch_size``); ``half`` (``max_batch_size / 2``); ``N`` or ``A+B+...``.

    Raises:
        ValueError: a token that is none of these.
    """
    t = token.strip().lower()
    if t == "none":
        return ()
    if t == "pow2":
        sizes = [1 << i for i in range(max_batch_size.bit_length()) if (1 << i) < max_batch_size]
        return canonical_preferred([*sizes, max_batch_size], max_batch_size)
    if t == "half":
        return canonical_preferred([max_batch_size // 2], max_batch_size)
    try:
        sizes = [int(p) for p in t.split("+")]
    except ValueError:
        raise ValueError(f"'{token}' is not none, pow2, half, N or A+B") from None
    return canonical_preferred(sizes, max_batch_size)


def check_preferred_token(token: str) -> str:
    """``token`` if :func:`resolve_preferred` understands it.

    Raises:
        ValueError: it does not, or a size is below 1.
    """
    t = token.strip().lower()
    if t in ("none", "pow2", "half"):
        return t
    try:
        sizes = [int(p) for p in t.split("+")]
    except ValueError:
        raise ValueError(f"'{token}' is not none, pow2, half, N or A+B") from None
    if any(s < 1 for s in sizes):
        raise ValueError(f"'{token}': preferred batch sizes are at least 1")
    return "+".join(str(s) for s in sorted(set(sizes)))


def preferred_token(sizes: Sequence[int]) -> str:
    """The token of canonical preferred sizes (``none`` or ``A+B``)."""
    return "+".join(str(s) for s in sizes) if sizes else "none"


@dataclass(frozen=True)
class Dimension:
    """One axis of the lattice: knob ``knob`` of ``models`` (usually one model),
    taking ``values`` in this order. Values: ints (instances, max_batch_size),
    tokens (preferred), ints or None (delay_us, None = no dynamic batching)."""

    knob: str
    models: tuple[str, ...]
    values: tuple[int | str | None, ...]

    @property
    def name(self) -> str:
        """``efficientnet_lite0.instances``."""
        return f"{'+'.join(self.models)}.{self.knob}"

    def show(self, value: int | str | None) -> str:
        """A value as the user writes it."""
        if self.knob == "delay_us":
            return OFF if value is None else str(value)
        return str(value)


@dataclass
class Space:
    """The lattice: ``dims`` over the ``shipped`` knobs of each model tuned.

    ``start`` is the shipped configuration's point (each dimension's index of the
    shipped value, which :func:`build_space` always includes).
    """

    shipped: dict[str, Knobs]
    dims: list[Dimension]
    start: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.start:
            self.start = tuple(d.values.index(self._shipped_value(d)) for d in self.dims)

    def _shipped_value(self, dim: Dimension) -> int | str | None:
        k = self.shipped[dim.models[0]]
        if dim.knob == "preferred":
            return preferred_token(k.preferred)
        return getattr(k, dim.knob)

    def knobs(self, index: Sequence[int]) -> Point | None:
        """The canonical configuration at lattice ``index``; None when invalid
        (preferred sizes above ``max_batch_size``)."""
        raw: dict[str, dict[str, Any]] = {
            m: {
                "instances": k.instances,
                "max_batch_size": k.max_batch_size,
                "preferred": preferred_token(k.preferred),
                "delay_us": k.delay_us,
            }
            for m, k in self.shipped.items()
        }
        for dim, i in zip(self.dims, index, strict=True):
            for m in dim.models:
                raw[m][dim.knob] = dim.values[i]
        out: Point = {}
        for m, r in raw.items():
            ship = self.shipped[m]
            if r["delay_us"] is None:
                # No dynamic batching: the batching knobs are the shipped ones.
                out[m] = replace(ship, instances=r["instances"], delay_us=None)
                continue
            mbs = r["max_batch_size"]
            preferred = resolve_preferred(r["preferred"], mbs)
            if preferred is None:
                return None
            out[m] = Knobs(r["instances"], mbs, preferred, r["delay_us"])
        return out

    def shipped_point(self) -> Point:
        """The shipped configuration (canonical)."""
        point = self.knobs(self.start)
        assert point is not None  # the shipped values are a valid point
        return point

    def neighbours(self, index: Sequence[int], radius: int = 1) -> list[tuple[int, ...]]:
        """Lattice points exactly ``radius`` steps away (L1 distance: the steps
        summed over the dimensions). Radius 1: one step along one dimension, in
        dimension order, the step down first; radius 2: two steps along one
        dimension first, then one step along each of two dimensions."""
        out = []
        n = len(self.dims)
        for moved in range(1, min(radius, n) + 1):  # fewer dimensions moved first
            for dims in itertools.combinations(range(n), moved):
                for sizes in _compositions(radius, moved):
                    for signs in itertools.product((-1, 1), repeat=moved):
                        point = list(index)
                        for d, size, sign in zip(dims, sizes, signs, strict=True):
                            point[d] += size * sign
                        if all(0 <= point[d] < len(self.dims[d].values) for d in dims):
                            out.append(tuple(point))
        return out

    def grid(self) -> Iterator[tuple[int, ...]]:
        """Every lattice point: the shipped one first, then in product order."""
        yield self.start
        for index in itertools.product(*(range(len(d.values)) for d in self.dims)):
            if index != self.start:
                yield index

    def size(self) -> int:
        """Lattice points (before canonicalization)."""
        n = 1
        for d in self.dims:
            n *= len(d.values)
        return n

    def describe_dims(self) -> list[str]:
        """One line per dimension: ``efficientnet_lite0.instances: 1, 2, [3]``
        (the shipped value in brackets)."""
        lines = []
        for dim, s in zip(self.dims, self.start, strict=True):
            vals = [f"[{dim.show(v)}]" if i == s else dim.show(v) for i, v in enumerate(dim.values)]
            lines.append(f"{dim.name}: {', '.join(vals)}")
        return lines


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Ways to write ``total`` as ``parts`` positive integers, in order."""
    if parts == 1:
        return [(total,)]
    return [
        (first, *rest)
        for first in range(1, total - parts + 2)
        for rest in _compositions(total - first, parts - 1)
    ]


def _with(values: Sequence[Any], shipped: Any, key: Any = None) -> tuple[Any, ...]:
    """``values`` plus ``shipped``, distinct, sorted by ``key`` (default: value)."""
    out = list(dict.fromkeys([*values, shipped]))
    return tuple(sorted(out, key=key) if key else sorted(out))


def _delay_order(v: int | None) -> int:
    return -1 if v is None else v


def default_instance_counts(cpus: int) -> list[int]:
    """1 to the CPUs the server may use, at least 2 and at most
    :data:`MAX_DEFAULT_INSTANCES`."""
    return list(range(1, min(MAX_DEFAULT_INSTANCES, max(2, cpus)) + 1))


def default_max_batch_sizes(shipped: int) -> list[int]:
    """Powers of two from 1 up to the shipped ``max_batch_size`` (the largest the
    model's author allows)."""
    return [1 << i for i in range(shipped.bit_length()) if (1 << i) <= shipped]


def build_space(
    target: str,
    shipped: Mapping[str, Knobs],
    *,
    ensemble_max_batch_size: int = 0,
    cpus: int = 2,
    instance_counts: Sequence[int] | None = None,
    max_batch_sizes: Sequence[int] | None = None,
    preferred: Sequence[str] | None = None,
    queue_delays_us: Sequence[int | None] | None = None,
) -> Space:
    """The lattice for ``target``.

    One model (``shipped`` has only ``target``): its instance count, and when it
    batches (``max_batch_size > 0``) its ``max_batch_size``, preferred sizes and
    queue delay (``None`` = no dynamic batching) — 4 dimensions.

    An ensemble (``shipped`` holds its steps, not the ensemble): each step's
    instance count and, for steps that batch, its queue delay; ``max_batch_size``
    and preferred sizes only when given (a step's ``max_batch_size`` stays at
    least ``ensemble_max_batch_size``, as an ensemble requires).

    Defaults: instances :func:`default_instance_counts` (``cpus``);
    ``max_batch_size`` :func:`default_max_batch_sizes`; preferred
    :data:`DEFAULT_PREFERRED`; delays :data:`DEFAULT_QUEUE_DELAYS_US` (one model)
    or :data:`DEFAULT_STEP_QUEUE_DELAYS_US` (steps). The shipped value is added to
    every dimension, so the shipped configuration is a point of the lattice.
    Dimensions with one value are left out.
    """
    pipeline = list(shipped) != [target]
    dims: list[Dimension] = []
    for model, k in shipped.items():
        counts = instance_counts or default_instance_counts(cpus)
        dims.append(Dimension("instances", (model,), _with(counts, k.instances)))
        if k.max_batch_size <= 0:
            continue
        if max_batch_sizes is not None or not pipeline:
            sizes = [
                s
                for s in (max_batch_sizes or default_max_batch_sizes(k.max_batch_size))
                if s >= max(1, ensemble_max_batch_size)
            ]
            dims.append(Dimension("max_batch_size", (model,), _with(sizes, k.max_batch_size)))
        if preferred is not None or not pipeline:
            tokens = list(preferred or DEFAULT_PREFERRED)
            ship_tok = preferred_token(k.preferred)
            values = tuple(dict.fromkeys([*tokens, ship_tok]))
            dims.append(Dimension("preferred", (model,), values))
        delays = queue_delays_us or (
            DEFAULT_STEP_QUEUE_DELAYS_US if pipeline else DEFAULT_QUEUE_DELAYS_US
        )
        dims.append(Dimension("delay_us", (model,), _with(delays, k.delay_us, _delay_order)))
    return Space(dict(shipped), [d for d in dims if len(d.values) > 1])


# --------------------------------------------------------------------------- configs


def ensemble_steps(cfg: ModelConfig) -> list[str]:
    """The models an ensemble's steps name, in step order, each once."""
    return list(dict.fromkeys(s.model_name for s in cfg.ensemble_scheduling.step))


def is_ensemble(cfg: ModelConfig) -> bool:
    """Whether a configuration is an ensemble's."""
    return cfg.platform == ENSEMBLE_PLATFORM or cfg.HasField("ensemble_scheduling")


def apply_knobs(
    base: ModelConfig, knobs: Knobs, shipped: Knobs, kind: int | None = None
) -> ModelConfig:
    """A copy of ``base`` (the shipped configuration, as written or as served)
    with ``knobs``; fields whose knob equals the shipped one are left as they are,
    so the copy differs from ``base`` only where the configuration changes.

    Instances: the count of the first instance group, the others removed; a
    configuration without ``instance_group`` gets one of ``kind`` (default
    ``KIND_CPU``). Dynamic batching off clears ``dynamic_batching``; on keeps the
    other fields of an existing one (queue policy, priorities...).
    """
    cfg = copy.deepcopy(base)
    if knobs.instances != shipped.instances:
        groups = cfg.instance_group
        if len(groups) == 0:
            group_kind = model_config_pb2.ModelInstanceGroup.KIND_CPU if kind is None else kind
            groups.add(count=knobs.instances, kind=group_kind)
        else:
            del groups[1:]
            groups[0].count = knobs.instances
    if knobs.max_batch_size != shipped.max_batch_size:
        cfg.max_batch_size = knobs.max_batch_size
    if knobs.delay_us is None:
        cfg.ClearField("dynamic_batching")
        return cfg
    db = cfg.dynamic_batching
    db.SetInParent()
    db.max_queue_delay_microseconds = knobs.delay_us
    current = canonical_preferred(tuple(db.preferred_batch_size), cfg.max_batch_size)
    if current != knobs.preferred:
        del db.preferred_batch_size[:]
        db.preferred_batch_size.extend(knobs.preferred)
    return cfg


def render(cfg: ModelConfig) -> str:
    """``config.pbtxt`` text of a configuration (protobuf text format; comments of
    the original file are not kept)."""
    return text_format.MessageToString(cfg)


def config_diff(model: str, shipped: ModelConfig, new: ModelConfig) -> str:
    """Unified diff ``a/<model>/config.pbtxt`` -> ``b/<model>/config.pbtxt`` of the
    two configurations rendered alike (:func:`render`); "" when they are equal."""
    a = render(shipped).splitlines(keepends=True)
    b = render(new).splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, f"a/{model}/config.pbtxt", f"b/{model}/config.pbtxt"))
