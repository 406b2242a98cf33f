"""Fixtures every GPU test module shares: one Device (primary context) and one stream per module.

Imports stay inside the fixtures so collecting these modules needs no GPU library."""
import pytest


@pytest.fixture(scope="module")
def dev():
    from executor.runtime import Device
    d = Device(0)
    yield d
    d.close()


@pytest.fixture(scope="module")
def stream(dev):
    return dev.stream()
