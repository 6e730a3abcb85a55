"""TensorRT engines built from an export folder: profiles, fp16, n-gram plugin, workers."""
