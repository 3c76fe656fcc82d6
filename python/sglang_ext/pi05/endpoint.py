"""Endpoint replacements that FastAPI serves like the originals, and the lookups their adapters share."""

import inspect
import sys

ACTION_PATH = "/v1/actions/generations"


def sibling(module, name: str):  # an imported module of the same package
    return sys.modules[module.__name__.rpartition(".")[0] + "." + name]


def post_route(router, path: str = ACTION_PATH):  # None: the router has no POST route at `path`
    return next((r for r in router.routes if getattr(r, "path", None) == path and "POST" in getattr(r, "methods", ())),
                None)


def like_endpoint(replacement, endpoint, request_cls):
    """`replacement` (async, one `request` argument) with `endpoint`'s doc and the signature by which
    FastAPI injects the Request: the class itself, not a name FastAPI would resolve in our module."""
    replacement.__doc__ = endpoint.__doc__
    replacement.__signature__ = inspect.Signature(
        [inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=request_cls)])
    return replacement
