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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not _HAVE_SM90:
            item.add_marker(pytest.mark.skip(reason=_WHY_NOT))
