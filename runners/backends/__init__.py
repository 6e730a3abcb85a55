"""Backends: they run an export folder's graphs and move tensors (ONNX Runtime, IOBinding, TensorRT); nothing else."""
