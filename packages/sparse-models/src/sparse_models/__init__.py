"""sparse_models."""
