"""Kernels that implement an external operator's contract exactly, so they can stand in for it."""
