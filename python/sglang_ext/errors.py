"""Exceptions of sglang-ext.

`SglangExtActivationError` derives from BaseException on purpose: sglang's
plugin loader (`sglang.srt.plugins.load_plugins`) and `HookRegistry.apply_hooks`
catch `Exception` and keep the server running unpatched. In strict mode a patch
that was asked for and could not be applied must stop start-up instead.
"""


class SglangExtActivationError(BaseException):
    """A requested patch could not be applied (strict mode): abort start-up."""


class ExtConfigError(ValueError):
    """Bad `--ext-*` flag / `SGLANG_EXT_*` value. Names the field and what is allowed."""
