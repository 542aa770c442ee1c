"""What the model manager knows about one model name: its serving versions and the
states the repository index reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.repository.model import ModelVersion
from pdserve.repository.traffic import TrafficSpec

#: Version states, as Triton's repository index names them.
READY = "READY"
UNAVAILABLE = "UNAVAILABLE"
LOADING = "LOADING"
UNLOADING = "UNLOADING"


@dataclass
class VersionState:
    """What the repository index reports for one version."""

    state: str
    reason: str = ""


@dataclass
class ModelEntry:
    """Everything known about one model name.

    Attributes:
        serving: version -> ready ModelVersion; replaced as a whole, never mutated.
        states: version -> state and reason (for the repository index).
        default_version: served when a request names no version (highest ready); set
            with ``serving``, a plain attribute the request path reads.
        traffic_free: traffic control found no traffic settings for the model (set by
            :meth:`~pdserve.repository.rollout.TrafficControl.route`; a load and the
            admin endpoint clear it): a request naming no version takes
            ``default_version`` without it.
        wanted: the model is meant to be served (a load was asked for and no unload
            since); ``--strict-readiness`` waits for every wanted model.
        traffic / traffic_gen: the traffic file (:mod:`pdserve.repository.traffic`)
            read by the last load that succeeded, and a counter of such loads.
        explicit: loaded because it was asked for by name (a load request,
            ``--load-model``, every model with ``--load-model=*`` or in ``none`` /
            ``poll`` mode, an on-demand request for it), not only as a step of an
            ensemble that was loaded (Triton's ``explicitly_load_``). Unloading an
            ensemble with ``unload_dependents`` unloads its steps that are not explicit.
    """

    name: str
    states: dict[int, VersionState] = field(default_factory=dict)
    reason: str = ""
    fingerprints: dict[int, str] = field(default_factory=dict)
    wanted: bool = False
    #: the model's traffic file (``traffic.yaml``) as of its last successful load.
    traffic: TrafficSpec | None = None
    #: counts loads that (re)read the traffic file (traffic control adopts each one).
    traffic_gen: int = 0
    #: asked for by name, not only loaded as an ensemble's step (see above).
    explicit: bool = False
    #: no traffic settings: requests naming no version skip traffic control (see above).
    traffic_free: bool = False
    #: the highest ready version (kept by the ``serving`` setter).
    default_version: ModelVersion | None = field(default=None, init=False)
    _serving: dict[int, ModelVersion] = field(default_factory=dict, init=False, repr=False)

    @property
    def serving(self) -> dict[int, ModelVersion]:
        """Version -> ready ModelVersion (assign a new dict to change it)."""
        return self._serving

    @serving.setter
    def serving(self, versions: dict[int, ModelVersion]) -> None:
        self._serving = versions
        self.default_version = versions[max(versions)] if versions else None
