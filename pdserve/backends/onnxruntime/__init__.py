"""The ONNX Runtime backend (``backend: "onnxruntime"``, ``platform: "onnxruntime_onnx"``)."""
