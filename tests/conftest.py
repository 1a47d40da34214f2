# tests/support (references, model zoo, site cases) and tests/probes (scripts the tests run in
# subprocesses) are on the import path: pyproject.toml [tool.pytest.ini_options] pythonpath.

import os
from pathlib import Path

import pytest
import torch

import one_unit_per_graph

# Inductor's CPU kernels of one graph built as one C++ unit, in the test processes and the
# Python processes they start (tests/support/one_unit/sitecustomize.py): the suite builds about
# 1,800 kernels, each g++ spending half its time re-reading Inductor's precompiled header
# (tests/support/one_unit_per_graph.py; measured times: docs/testing.md)
# (RLA_TESTS_KERNEL_BY_KERNEL=1: Inductor's own build, to compare)
if os.environ.get("RLA_TESTS_KERNEL_BY_KERNEL") != "1":
    one_unit_per_graph.install()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).parent / "support" / "one_unit"), os.environ.get("PYTHONPATH")]))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
