"""Fixture shared by the activation and doctor tests (import it into a test module to use it)."""

from __future__ import annotations

import os

import pytest

from sglang_ext import activation


@pytest.fixture(autouse=True)
def clean_activation(monkeypatch):
    """No inherited SGLANG_EXT* variables and no activation left over, before and after each test."""
    for name in list(os.environ):
        if name == "SGLANG_EXT" or name.startswith("SGLANG_EXT_"):
            monkeypatch.delenv(name)
    activation.deactivate()
    yield
    activation.deactivate()
