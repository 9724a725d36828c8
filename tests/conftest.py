import os

import pytest
import torch


def _sm90_kernels() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if torch.cuda.get_device_capability() != (9, 0):
        return False, f"needs sm_90, device is sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    import flash_epilogue

    if not flash_epilogue.kernels_available():
        return False, f"kernels not built: {flash_epilogue.UNAVAILABLE_REASON}"
    return True, ""


_HAVE_SM90, _WHY_NOT = _sm90_kernels()
requires_sm90 = pytest.mark.skipif(not _HAVE_SM90, reason=_WHY_NOT)


@pytest.fixture(autouse=True)
def _env_flags_follow_the_environment():
    """flash_epilogue reads FLASH_EPILOGUE_DEBUG / FLASH_EPILOGUE_CHECK_INPUTS once, at import; a test
    that sets them calls flash_epilogue.refresh_env_flags(). Re-read before each test, when the
    previous test's monkeypatch has restored the environment."""
    from flash_epilogue import ops

    ops.refresh_env_flags()
    yield


@pytest.fixture
def sm90(monkeypatch):
    """Pretend every tensor is on an sm_90 CUDA device with kernels compiled for sm_90a (the
    validation tests' device hooks, flash_epilogue.validation)."""
    import flash_epilogue.validation as V

    monkeypatch.setattr(V, "_is_cuda_device", lambda device: True)
    monkeypatch.setattr(V, "_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(V, "_compiled_archs", lambda: ("sm_90a",))


@pytest.fixture(autouse=True)
def _cpp_parity(request, monkeypatch):
    """FLASH_EPILOGUE_TEST_CPP_PARITY=<file>: every Python validator call also runs the C++ op and
    compares (tests/cpp_parity.py; tests/test_cpp_parity.py sets it)."""
    path = os.environ.get("FLASH_EPILOGUE_TEST_CPP_PARITY")
    if not path:
        yield
        return
    import cpp_parity
    import flash_epilogue.validation as V

    comparer = cpp_parity.Comparer(path, request.node.nodeid)
    for name in cpp_parity.SPECS:
        wrapped = comparer.wrap(name)
        monkeypatch.setattr(V, name, wrapped)
        if request.module is not None and getattr(request.module, name, None) is cpp_parity.REAL[name]:
            monkeypatch.setattr(request.module, name, wrapped)
    yield


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not _HAVE_SM90:
            item.add_marker(pytest.mark.skip(reason=_WHY_NOT))
