"""Exceptions of sglang-ext."""


class SglangExtActivationError(BaseException):
    """A requested patch could not be applied (strict mode): abort start-up. A BaseException, so
    sglang's plugin loader, which catches Exception, cannot swallow it."""


class ExtConfigError(ValueError):
    """Bad `--ext-*` flag / `SGLANG_EXT_*` value. Names the field and what is allowed."""
