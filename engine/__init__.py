"""DeepInfer attention subsystem: sparse MLA kernels, entry points and a small serving engine."""
