"""A stand-in for the sglang package: the generator's synthetic target (tests only)."""
