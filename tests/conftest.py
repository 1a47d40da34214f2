import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # contract_reference, site_cases, models

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
