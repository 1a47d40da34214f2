# tests/support (references, model zoo, site cases) and tests/probes (scripts the tests run in
# subprocesses) are on the import path: pyproject.toml [tool.pytest.ini_options] pythonpath.

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
