"""elx exporter: HF models to ONNX graphs + manifest, graph passes, verification, compare and bench (needs PyTorch)."""
