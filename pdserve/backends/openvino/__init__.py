"""OpenVINO backend (``backend: "openvino"``): OpenVINO IR and ONNX models."""
