# tests/support (references, model zoo, site cases) and tests/probes (scripts the tests run in
# subprocesses) are on the import path: pyproject.toml [tool.pytest.ini_options] pythonpath.

import pytest
import torch

import one_unit_per_graph

# Inductor's CPU kernels of one graph built as one C++ unit, in the test processes only: the
# suite builds about 1,800 kernels, each g++ spending half its time re-reading Inductor's
# precompiled header (tests/support/one_unit_per_graph.py; measured times: docs/testing.md)
one_unit_per_graph.install()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
