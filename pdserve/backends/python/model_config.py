"""``pb_utils.ModelConfig``: the configuration a python model's ``auto_complete_config``
reads and completes, in Triton's JSON form (Triton's helper class)."""

from __future__ import annotations

import json
from typing import Any


class ModelConfig:
    """The configuration handed to ``auto_complete_config`` (Triton's helper class).

    Only ``max_batch_size``, inputs, outputs, the dynamic batcher, the transaction
    policy and warm-up may be changed, as in Triton.

    Args:
        model_config: the configuration as a JSON string (Triton's JSON form).
    """

    def __init__(self, model_config: str | dict[str, Any]) -> None:
        self._model_config: dict[str, Any] = (
            json.loads(model_config) if isinstance(model_config, str) else model_config
        )
        self._model_config.setdefault("input", [])
        self._model_config.setdefault("output", [])
        self._model_config.setdefault("max_batch_size", 0)

    def as_dict(self) -> dict[str, Any]:
        """The configuration as a dict (changes go through the setters)."""
        return self._model_config

    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """Set ``max_batch_size``.

        Raises:
            ValueError: the configuration already sets a larger non-zero value.
        """
        current = int(self._model_config.get("max_batch_size", 0))
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in auto-complete-config "
                f"function for model '{self._name()}' specified max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        """Use the dynamic batcher unless another scheduler is configured.

        Raises:
            ValueError: ``sequence_batching`` or ``ensemble_scheduling`` is set.
        """
        for other in ("sequence_batching", "ensemble_scheduling"):
            if self._model_config.get(other):
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but "
                    f"auto-complete-config function for model '{self._name()}' tries to set "
                    "scheduling_choice as 'dynamic_batching'"
                )
        if not self._model_config.get("dynamic_batching"):
            self._model_config["dynamic_batching"] = {}

    def _add_io(self, kind: str, io: dict[str, Any], valid: tuple[str, ...]) -> None:
        if not isinstance(io, dict):
            raise ValueError(f"{kind} in auto-complete-config function must be a dict")
        for key in io:
            if key not in valid:
                raise ValueError(
                    f"{kind} '{io.get('name', '')}' in auto-complete-config function for model "
                    f"'{self._name()}' contains property other than {', '.join(valid)}."
                )
        for key in ("name", "data_type", "dims"):
            if key not in io:
                raise ValueError(
                    f"{kind} '{io.get('name', '')}' in auto-complete-config function for model "
                    f"'{self._name()}' is missing '{key}' property."
                )
        for current in self._model_config[kind]:
            if current.get("name") != io["name"]:
                continue
            cur_type = current.get("data_type", "TYPE_INVALID")
            if cur_type not in ("", "TYPE_INVALID") and cur_type != io["data_type"]:
                raise ValueError(
                    f"unable to load model '{self._name()}', configuration expects datatype "
                    f"{cur_type} for {kind} '{io['name']}', model provides {io['data_type']}"
                )
            cur_dims = [int(d) for d in current.get("dims", [])]
            if cur_dims and cur_dims != [int(d) for d in io["dims"]]:
                raise ValueError(
                    f"model '{self._name()}', tensor '{io['name']}': the model expects dims "
                    f"{list(io['dims'])} but the model configuration specifies dims {cur_dims}"
                )
            current.update(io)
            return
        self._model_config[kind].append(dict(io))

    def add_input(self, input: dict[str, Any]) -> None:  # noqa: A002 - Triton's name
        """Add (or complete) an input ``{"name", "data_type", "dims"[, "optional"]}``.

        Raises:
            ValueError: missing/unknown properties, or it contradicts the configuration.
        """
        self._add_io("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict[str, Any]) -> None:
        """Add (or complete) an output ``{"name", "data_type", "dims"}``.

        Raises:
            ValueError: missing/unknown properties, or it contradicts the configuration.
        """
        self._add_io("output", output, ("name", "data_type", "dims"))

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        """Set ``model_transaction_policy`` (only ``decoupled`` is a valid key).

        Raises:
            ValueError: an unknown key, or it contradicts the configuration.
        """
        for key in transaction_policy_dict:
            if key != "decoupled":
                raise ValueError(
                    f"model transaction property in auto-complete-config function for model "
                    f"'{self._name()}' contains property other than 'decoupled'"
                )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        want = bool(transaction_policy_dict.get("decoupled", False))
        if "decoupled" in policy and bool(policy["decoupled"]) != want:
            raise ValueError(
                f"trying to change decoupled property in auto-complete-config for model "
                f"'{self._name()}', which is already set to {policy['decoupled']}"
            )
        policy["decoupled"] = want

    def add_model_warmup(self, model_warmup: dict[str, Any]) -> None:
        """Append a ``model_warmup`` entry (needs ``name``, ``batch_size``, ``inputs``).

        Raises:
            ValueError: missing properties.
        """
        for key in ("name", "batch_size", "inputs"):
            if key not in model_warmup:
                raise ValueError(f"model_warmup entry is missing '{key}'")
        self._model_config.setdefault("model_warmup", []).append(dict(model_warmup))
