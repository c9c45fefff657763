"""Sparse MLA attention: the float32 reference, the dispatcher, the engine's entry points and the kernels."""
