"""sparse_serve."""
