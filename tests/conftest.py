"""Shared pytest configuration: float64 by default, ``--device``/``--dtype`` switchable."""

from __future__ import annotations

import pytest
import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu", help="torch device for the tests (cpu, cuda)")
    parser.addoption("--dtype", default="float64", choices=["float32", "float64"])


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.config.getoption("--device"))


@pytest.fixture(scope="session")
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return getattr(torch, request.config.getoption("--dtype"))


@pytest.fixture(autouse=True)
def _seed_and_threads() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
