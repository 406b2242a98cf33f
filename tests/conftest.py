"""Test tiers: CPU tests run everywhere; tests marked `gpu` need an SM90 GPU and skip cleanly without one."""
import functools

import pytest


@functools.lru_cache(maxsize=1)
def sm90_gpu_reason() -> str | None:
    """None when an SM90 GPU is usable, else why not (the skip reason)."""
    try:
        from cuda.bindings import driver as cu
    except Exception as exc:  # noqa: BLE001 - any import failure means no GPU path
        return f"cuda-python not importable: {exc}"
    try:
        err, = cu.cuInit(0)
    except Exception as exc:  # noqa: BLE001 - no libcuda on this machine
        return f"no CUDA driver: {exc}"
    if err != cu.CUresult.CUDA_SUCCESS:
        return f"no CUDA driver/GPU (cuInit: {err.name})"
    err, dev = cu.cuDeviceGet(0)
    if err != cu.CUresult.CUDA_SUCCESS:
        return f"no CUDA device (cuDeviceGet: {err.name})"
    attr = cu.CUdevice_attribute
    _, major = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    _, minor = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    if (major, minor) != (9, 0):
        return f"GPU is sm_{major}{minor}, kernels are built for sm_90a"
    return None


def pytest_collection_modifyitems(config, items):
    reason = sm90_gpu_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_bundle_dir(tmp_path_factory):
    """The tiny TP4 bundle: HOPDEC_BUNDLE when it holds a manifest (what `make test` exports and
    builds), else built here once (CPU only) with a private compile cache."""
    import os
    from pathlib import Path

    env = os.environ.get("HOPDEC_BUNDLE")
    if env and (Path(env) / "manifest.json").is_file():
        return Path(env)
    from kernels import build

    path = tmp_path_factory.mktemp("bundle")
    saved = os.environ.get("HOPDEC_CACHE_DIR")
    os.environ["HOPDEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    try:
        build.build_bundle("tiny", 4, path, log=lambda *_: None)
    finally:
        if saved is None:
            del os.environ["HOPDEC_CACHE_DIR"]
        else:
            os.environ["HOPDEC_CACHE_DIR"] = saved
    return path
