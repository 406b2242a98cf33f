"""Fixtures every GPU test module shares: one Device (primary context) and one stream per module,
and the kernel bundles the tests launch from.

Bundles: HOPDEC_BUNDLE (tiny, default build/bundle-tiny), HOPDEC_BUNDLE_V41 (v41-flash widths,
default build/bundle-v41-flash-tp4) and HOPDEC_BENCH_BUNDLE (the step benchmark's, default
build/bundle-v41-bench-step-tp4). Imports stay inside the fixtures so collecting these modules
needs no GPU library."""
import contextlib
import os
from pathlib import Path

import pytest

PRESET_BUNDLES = {"tiny": ("HOPDEC_BUNDLE", "build/bundle-tiny"),
                  "v41-flash": ("HOPDEC_BUNDLE_V41", "build/bundle-v41-flash-tp4")}
BENCH_BUNDLE = ("HOPDEC_BENCH_BUNDLE", "build/bundle-v41-bench-step-tp4")


@contextlib.contextmanager
def _opened_bundle(dev, env: str, default: str, missing, reason: str):
    """The bundle at $`env` (else `default`), closed on exit; without a manifest there,
    `missing(reason)` instead (pytest.skip or pytest.fail; `{path}` in `reason` names the
    directory)."""
    path = Path(os.environ.get(env, default))
    if not (path / "manifest.json").is_file():
        missing(reason.format(path=path))
    from executor.runtime import Bundle
    bundle = Bundle.load(dev, path)
    try:
        yield bundle
    finally:
        bundle.close()


@pytest.fixture(scope="module")
def dev():
    from executor.runtime import Device
    d = Device(0)
    yield d
    d.close()


@pytest.fixture(scope="module")
def stream(dev):
    return dev.stream()


@pytest.fixture(scope="module", params=sorted(PRESET_BUNDLES))
def preset(request) -> str:
    """Each model preset with a bundle: the tests that use it run at tiny and at v41-flash
    widths (case ids `[tiny]`, `[v41-flash]`)."""
    return request.param


@pytest.fixture(scope="module")
def preset_bundle(dev, preset):
    """(ModelConfig, Bundle) of `preset`; a missing bundle skips that preset's cases with the
    reason."""
    from loader.config import ModelConfig
    env, default = PRESET_BUNDLES[preset]
    reason = f"no {preset} kernel bundle at {{path}} (set {env})"
    with _opened_bundle(dev, env, default, pytest.skip, reason) as bundle:
        yield ModelConfig.preset(preset), bundle


@pytest.fixture(scope="module")
def tiny_bundle(dev):
    """The tiny bundle alone (runtime and executor probes); missing, the tests skip."""
    reason = "no kernel bundle at {path} (set HOPDEC_BUNDLE or run make bundle)"
    with _opened_bundle(dev, *PRESET_BUNDLES["tiny"], pytest.skip, reason) as bundle:
        yield bundle


@pytest.fixture(scope="module")
def v41_bundle(dev):
    """The v41-flash bundle alone, for kernels built only at v41-flash widths; missing, the tests
    fail (a run that should have built it did not)."""
    reason = "no bundle at {path} (python -m kernels.build --config v41-flash --tp 4)"
    with _opened_bundle(dev, *PRESET_BUNDLES["v41-flash"], pytest.fail, reason) as bundle:
        yield bundle


@pytest.fixture(scope="module")
def bench_bundle(dev):
    """The step-benchmark bundle (real-dimension slices of the whole step); missing, the tests
    skip."""
    reason = "no step-benchmark bundle at {path} (make bundles, or set HOPDEC_BENCH_BUNDLE)"
    with _opened_bundle(dev, *BENCH_BUNDLE, pytest.skip, reason) as bundle:
        yield bundle
