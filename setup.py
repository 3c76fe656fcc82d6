"""sglang-ext: layout-keyed, capacity-bounded CUDA graphs for SGLang 0.5.17.

Deliberately declares no install_requires: sglang and torch belong to the user
and are pinned by them. The supported sglang range is checked at run time
(sglang_ext.versions.SUPPORTED_SGLANG). `sglang_ext_testkit` (test/) is the test and
benchmark kit the scripts and tests import; sglang_ext never imports it.
"""
import os

from setuptools import find_packages, setup

# The kit travels with a clone, not with copies of the package alone (the GPU harness installs python/).
KIT = {"sglang_ext_testkit": "test/sglang_ext_testkit"} if os.path.isdir("test/sglang_ext_testkit") else {}

setup(
    name="sglang-ext",
    version="0.1.0",
    description="Layout-keyed, capacity-bounded, workspace-stable CUDA graphs for SGLang",
    license="Apache-2.0",
    package_dir={"": "python", **KIT},
    packages=find_packages("python") + list(KIT),
    package_data={"sglang_ext": ["fingerprints/*.json"]},
    python_requires=">=3.10",
    install_requires=[],
    extras_require={"sglang": ["sglang>=0.5.17,<0.5.18"]},
    entry_points={
        "sglang.srt.plugins": ["sglang_ext = sglang_ext.plugin:register"],
        "sglang.multimodal_gen.plugins": ["sglang_ext = sglang_ext.plugin:register"],
        "console_scripts": ["sglang-ext = sglang_ext.tools.cli:main"],
    },
)
