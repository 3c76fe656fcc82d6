"""A replacement of a FastAPI endpoint that FastAPI still serves like the original."""

import inspect


def like_endpoint(replacement, endpoint, request_cls):
    """`replacement` (async, one `request` argument) with `endpoint`'s doc and the signature by which
    FastAPI injects the Request: the class itself, not a name FastAPI would resolve in our module."""
    replacement.__doc__ = endpoint.__doc__
    replacement.__signature__ = inspect.Signature(
        [inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=request_cls)])
    return replacement
