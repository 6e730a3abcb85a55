"""elx: lossless faster generation (ONNX export, exact attention passes, ONNX Runtime/TensorRT runners)."""

__version__ = "0.1.0"
