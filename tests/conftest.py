"""Shared test setup: every test starts from the same seed."""

import pytest
import torch


@pytest.fixture(autouse=True)
def manual_seed_zero() -> None:
    torch.manual_seed(0)
