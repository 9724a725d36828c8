// The devices (device.h).

#include "device.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string_view>

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

namespace flash_epilogue {

namespace {

struct DeviceInfo {
  std::pair<int, int> capability;
  int multiprocessors = 0;
};

DeviceInfo const& device_info(int device) {  // read once per device
  static std::mutex mutex;
  static std::map<int, DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto const it = cache.find(device); it != cache.end()) { return it->second; }
  DeviceInfo info;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.capability.first, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.capability.second, cudaDevAttrComputeCapabilityMinor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.multiprocessors, cudaDevAttrMultiProcessorCount, device));
  return cache[device] = info;
}

}  // namespace

std::vector<std::string> const& compiled_archs() {
  static std::vector<std::string> const archs = [] {
    std::vector<std::string> out(1);  // from setup.py's comma-separated list
    for (char c : std::string_view(FLASH_EPILOGUE_COMPILED_ARCHS)) { c == ',' ? out.emplace_back() : out.back() += c; }
    return out;
  }();
  return archs;
}

bool compiled_for(char const* arch) { return std::count(compiled_archs().begin(), compiled_archs().end(), arch) > 0; }

bool has_kernels(std::pair<int, int> capability) {
  return (capability == std::pair{9, 0} && compiled_for("sm_90a")) || (capability.first == 8 && compiled_for("sm_80"));
}

std::pair<int, int> device_capability(int device) { return device_info(device).capability; }

int multiprocessor_count(int device) { return device_info(device).multiprocessors; }

void bind_primary_context(int device) {
  thread_local uint64_t bound = 0;  // bit d: device d bound
  uint64_t const bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (bound & bit) != 0) { return; }
  C10_CUDA_CHECK(cudaSetDevice(device));
  bound |= bit;
}

}  // namespace flash_epilogue
