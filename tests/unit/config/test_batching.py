"""pdserve.config.batching: dynamic and sequence batching rules, called directly."""

from __future__ import annotations

from collections.abc import Callable

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.config import batching


def _cfg(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _failures(
    check: Callable[..., None], cfg: model_config_pb2.ModelConfig, *args: object
) -> list[str]:
    found: list[str] = []

    def fail(field: str, message: str) -> None:
        found.append(f"{field}: {message}")

    check(cfg, *args, fail)
    return found


def test_dynamic_batching_sizes_and_warning() -> None:
    cfg = _cfg("name: 'm' max_batch_size: 0 dynamic_batching { preferred_batch_size: [2] }")
    warnings: list[str] = []
    found = _failures(batching.validate_dynamic_batching, cfg, "m/config.pbtxt", warnings)
    assert found == [
        "dynamic_batching.preferred_batch_size: preferred batch size 2: batching asked of a "
        "model that cannot batch (max_batch_size is 0)"
    ]
    assert warnings and "never batched" in warnings[0]


def test_sequence_batching_controls_and_states() -> None:
    cfg = _cfg(
        """
        name: "m" max_batch_size: 4
        input { name: "x" data_type: TYPE_FP32 dims: [1] }
        sequence_batching {
          control_input { name: "x" control { kind: CONTROL_SEQUENCE_START } }
          state { input_name: "s_in" output_name: "s_out" data_type: TYPE_FP32 dims: [0] }
        }
        """
    )
    found = _failures(batching.validate_sequence_batching, cfg)
    assert "sequence_batching.control_input[0].name: control input name 'x' is already used" in (
        found
    )
    assert any(f.startswith("sequence_batching.control_input[0].control:") for f in found)
    assert "sequence_batching.state[0].dims: a sequence state must specify 'dims', each >= 1" in (
        found
    )


def test_sequence_batching_well_formed() -> None:
    cfg = _cfg(
        """
        name: "m" max_batch_size: 4
        input { name: "x" data_type: TYPE_FP32 dims: [1] }
        sequence_batching {
          control_input { name: "start" control { kind: CONTROL_SEQUENCE_START
                                                   int32_false_true: [0, 1] } }
          control_input { name: "corrid" control { kind: CONTROL_SEQUENCE_CORRID
                                                    data_type: TYPE_UINT64 } }
        }
        """
    )
    assert _failures(batching.validate_sequence_batching, cfg) == []
