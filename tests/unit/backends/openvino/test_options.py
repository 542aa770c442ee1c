"""The OpenVINO parameters, read as Triton's openvino backend reads them."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.backends.openvino.options import Options, device_property


def _cfg(**params: str) -> model_config_pb2.ModelConfig:
    text = "".join(
        f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n' for k, v in params.items()
    )
    return text_format.Parse(text, model_config_pb2.ModelConfig(name="m"))


def test_device_properties_and_switches() -> None:
    opts = Options.from_config(
        _cfg(
            NUM_STREAMS="2",
            PERFORMANCE_HINT="throughput",
            INFERENCE_NUM_THREADS="3",
            HINT_BF16="Yes",
            SKIP_OV_DYNAMIC_BATCHSIZE="YES",
            ENABLE_BATCH_PADDING="yes",
            RESHAPE_IO_LAYERS="no",
            TARGET_DEVICE="cpu",
        )
    )
    assert opts.properties == {
        "NUM_STREAMS": 2,
        "PERFORMANCE_HINT": "THROUGHPUT",
        "INFERENCE_NUM_THREADS": 3,
        "INFERENCE_PRECISION_HINT": "bf16",
    }
    assert (opts.skip_dynamic_batchsize, opts.enable_batch_padding) == (True, True)
    assert opts.reshape_io_layers is False  # only YES turns a switch on
    assert opts.target_device == "CPU"
    assert Options.from_config(_cfg()) == Options()


@pytest.mark.parametrize(
    ("key", "value", "want"),
    [
        ("NUM_STREAMS", "AUTO", ("NUM_STREAMS", "AUTO")),
        ("NUM_STREAMS", "numa", ("NUM_STREAMS", "NUMA")),
        (
            "PERFORMANCE_HINT",
            "Cumulative_Throughput",
            ("PERFORMANCE_HINT", "CUMULATIVE_THROUGHPUT"),
        ),
        ("COMPILATION_NUM_THREADS", "0", ("COMPILATION_NUM_THREADS", 0)),
    ],
)
def test_values_are_case_insensitive(key: str, value: str, want: tuple[str, object]) -> None:
    assert device_property(key, value) == want


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("NUM_STREAMS", "many", "'NUM_STREAMS' to be either AUTO/NUMA/<int_value>, got many"),
        ("INFERENCE_NUM_THREADS", "-1", "'INFERENCE_NUM_THREADS' to be a non-negative number"),
        ("PERFORMANCE_HINT", "fast", "LATENCY/THROUGHPUT/CUMULATIVE_THROUGHPUT, got fast"),
        ("HINT_BF16", "no", "'HINT_BF16' to be YES, got no"),
    ],
)
def test_malformed_values_are_refused_with_tritons_message(
    key: str, value: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        Options.from_config(_cfg(**{key: value}))
