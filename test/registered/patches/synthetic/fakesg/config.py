"""A dataclass config (synthetic target of test_patch_series)."""

from dataclasses import dataclass


@dataclass
class Config:
    size: int = 1

    def describe(self):
        return f"size={self.size}"
