"""Triton kernels; imported only once a Triton backend is chosen (Triton is optional on CPU)."""
