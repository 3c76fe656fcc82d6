"""sglang-ext."""
