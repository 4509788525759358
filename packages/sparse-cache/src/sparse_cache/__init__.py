"""sparse_cache."""
