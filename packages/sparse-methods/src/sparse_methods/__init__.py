"""sparse_methods."""
