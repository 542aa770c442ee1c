"""A model's configuration from config.pbtxt to what its backend loads.

The steps a configuration goes through before a backend loads a version, in
Triton's order (see :mod:`pdserve.config`): read and normalize the platform/backend
pair (:func:`read_config`), then per version the backend's auto-complete, Triton's
defaults, the generic validation and the host-policy check
(:func:`complete_config`). The model manager (``pdserve serve``) and ``pdserve
check`` both run exactly these functions, so a repository that checks clean gets
past them at load too, with the same messages.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping

from pdserve import config as cfgmod
from pdserve.backends import host_policy
from pdserve.backends.base import Backend, ModelSpec
from pdserve.backends.registry import get_backend, unavailable_reason
from pdserve.repository import layout
from pdserve.scheduling import rate_limiter
from pdserve.scheduling.ensemble import EnsembleBackend
from pdserve.scheduling.padding import validate_padding

#: Whether backends may auto-complete configurations (``--disable-auto-complete-config``
#: turns it off for the serving process: :func:`set_auto_complete`).
_AUTO_COMPLETE = [True]

#: The fields auto-complete fills that a configuration must give when it is off.
_COMPLETED_FIELDS = ("input", "output", "max_batch_size", "dynamic_batching")


def set_auto_complete(enabled: bool) -> None:
    """Let backends auto-complete configurations (the default), or not: then a model
    needs a config.pbtxt, and one that leaves to auto-complete a field of
    :data:`_COMPLETED_FIELDS` fails to load (tritonserver's
    ``--disable-auto-complete-config``)."""
    _AUTO_COMPLETE[0] = enabled


#: Ensembles are not backends (Triton runs them in its ensemble scheduler); this one
#: object loads every ensemble's plan in a server.
ENSEMBLE_BACKEND = EnsembleBackend()


def read_config(
    mdir: layout.ModelDir,
    config_override: cfgmod.ModelConfig | None = None,
    where: str | None = None,
) -> cfgmod.ModelConfig:
    """A model's configuration with its platform and backend filled in.

    ``<model>/config.pbtxt`` (:func:`pdserve.config.load_model_config`), or a copy of
    ``config_override`` (the repository API's), then
    :func:`pdserve.config.normalize_platform` with the backend registry's check (a
    backend this server cannot run is an error here) and the names in the model's
    version folders to guess the backend from.

    Args:
        mdir: the model folder (:func:`pdserve.repository.layout.scan_repository`).
        config_override: a ``ModelConfig`` that replaces config.pbtxt, or None.
        where: how messages name the configuration (default: ``<model>/config.pbtxt``, relative to the repository).

    Raises:
        pdserve.config.ConfigError: the file does not parse, the name differs from
            the folder's, or the platform/backend is unknown, inconsistent or cannot
            run here (naming the file and field).
    """
    if config_override is None and not _AUTO_COMPLETE[0]:
        if not (mdir.path / cfgmod.CONFIG_FILENAME).is_file():
            raise cfgmod.ConfigError(
                where or f"{mdir.name}/{cfgmod.CONFIG_FILENAME}",
                "file",
                "no model configuration file, and auto-complete is off "
                "(--disable-auto-complete-config)",
            )
    cfg = (
        copy.deepcopy(config_override)
        if config_override is not None
        else cfgmod.load_model_config(mdir.path)
    )
    if not cfg.name:
        cfg.name = mdir.name
    cfgmod.normalize_platform(
        cfg,
        where or f"{mdir.name}/{cfgmod.CONFIG_FILENAME}",
        guess_from_files=[f for v in mdir.versions for f in layout.version_dir_files(mdir, v)],
        backends=unavailable_reason,
    )
    return cfg


def backend_for(cfg: cfgmod.ModelConfig) -> Backend:
    """The backend that loads ``cfg`` (:data:`ENSEMBLE_BACKEND` for an ensemble).

    Raises:
        ValueError: the backend cannot run here (the registry's reason).
    """
    if cfg.platform == cfgmod.ENSEMBLE_PLATFORM:
        return ENSEMBLE_BACKEND
    return get_backend(cfg.backend)


async def complete_config(
    spec: ModelSpec,
    backend: Backend,
    host_policies: Mapping[str, frozenset[int]] | None = None,
    errors: list[cfgmod.ConfigError] | None = None,
    where: str | None = None,
) -> list[str]:
    """Complete and validate one version's configuration (``spec.config``) in place.

    The backend's ``auto_complete`` (awaited when it is a coroutine: the python
    backend runs model code in a worker for it), then
    :func:`pdserve.config.apply_defaults` (``KIND_AUTO`` groups become GPU groups on
    ``backend.usable_gpus()``), :func:`pdserve.config.validate_config` with the
    backend registry's check, the ``padding`` parameter's check
    (:func:`pdserve.scheduling.padding.validate_padding`), the rate limiter's resources
    (:func:`pdserve.scheduling.rate_limiter.check_config`), and
    :func:`pdserve.backends.host_policy.check_instance_groups` against
    ``host_policies`` (skipped when None).

    Args:
        spec: the version (its ``config`` is changed in place).
        backend: what loads it (:func:`backend_for`, or ``pdserve check``'s own).
        host_policies: the server's host policies, or None not to check them.
        errors: when given, the validation and host-policy problems are appended to
            it, all of them, instead of the first being raised (``pdserve check``);
            auto-complete still raises.
        where: how messages name the configuration (default: ``<model>/config.pbtxt``, relative to the repository).

    Returns:
        validation warnings (:func:`pdserve.config.validate_config`).

    Raises:
        pdserve.config.ConfigError: auto-complete or validation failed (file, field).
        pdserve.backends.host_policy.HostPolicyError: an instance group names a host
            policy not given.
        Exception: what the backend's auto-complete raised (an ONNX file ONNX
            Runtime cannot load, a missing model file...).
    """
    cfg = spec.config
    given = {f: getattr(cfg, f) for f in _COMPLETED_FIELDS}
    given = copy.deepcopy(given)
    completing = backend.auto_complete(spec)
    if inspect.isawaitable(completing):
        await completing
    if not _AUTO_COMPLETE[0] and backend is not ENSEMBLE_BACKEND:
        filled = [f for f in _COMPLETED_FIELDS if getattr(cfg, f) != given[f]]
        if filled:
            raise cfgmod.ConfigError(
                where or f"{spec.name}/{cfgmod.CONFIG_FILENAME}",
                filled[0],
                f"auto-complete is off (--disable-auto-complete-config): the configuration "
                f"must give {', '.join(filled)} itself",
            )
    cfgmod.apply_defaults(cfg, gpus=backend.usable_gpus())
    where = where or f"{spec.name}/{cfgmod.CONFIG_FILENAME}"
    warnings = cfgmod.validate_config(
        cfg, where, model_dir=spec.model_dir, backends=unavailable_reason, errors=errors
    )

    def fail(field: str, message: str) -> None:
        error = cfgmod.ConfigError(where, field, message)
        if errors is None:
            raise error
        errors.append(error)

    validate_padding(cfg, fail)  # the ``padding`` parameter
    try:
        rate_limiter.check_config(cfg, where)  # resources the command line cannot grant
    except cfgmod.ConfigError as e:
        fail(e.field, e.message)
    if host_policies is not None:
        try:
            host_policy.check_instance_groups(spec.name, cfg, host_policies)
        except host_policy.HostPolicyError as e:
            if errors is None:
                raise
            errors.append(cfgmod.ConfigError(where, "instance_group", str(e)))
    return warnings
