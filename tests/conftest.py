# tests/support (references, model zoo, site cases) and tests/probes (scripts the tests run in
# subprocesses) are on the import path: pyproject.toml [tool.pytest.ini_options] pythonpath.

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# Tests that read one expensive module-scoped fixture run on the same pytest-xdist worker (tox
# runs `--dist loadgroup`), so the fixture is built once per run instead of once per worker
# (the FSDP/TP probes, the coverage collection and the vLLM probes took minutes each, twice).
SHARED_FIXTURES = ("coverage", "distributed", "distributed_2d", "sequences", "fp32_model", "models", "rla_probe")


def pytest_collection_modifyitems(items):
    for item in items:
        shared = [name for name in SHARED_FIXTURES if name in getattr(item, "fixturenames", ())]
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.path.stem}.{shared[0]}"))
