"""sparse_kernels."""
