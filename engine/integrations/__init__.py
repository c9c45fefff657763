"""Integrations of the engine's kernels into other frameworks (transformers)."""
