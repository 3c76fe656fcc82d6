"""Exceptions of sglang-ext."""


class SglangExtActivationError(BaseException):
    """A requested patch failed in strict mode: abort start-up (not an Exception, which sglang's loader eats)."""


class ExtConfigError(ValueError):
    """Bad `--ext-*` flag / `SGLANG_EXT_*` value. Names the field and what is allowed."""
