// The devices (device.h).

#include "device.h"

#include <algorithm>
#include <atomic>
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

DeviceInfo read_device_info(int device) {
  DeviceInfo info;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.capability.first, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.capability.second, cudaDevAttrComputeCapabilityMinor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.multiprocessors, cudaDevAttrMultiProcessorCount, device));
  return info;
}

// Read once per device; every op call reads it, so the first kMaxCached devices take no lock once read.
DeviceInfo const& device_info(int device) {
  constexpr int kMaxCached = 64;
  static DeviceInfo cached[kMaxCached];
  static std::atomic<bool> ready[kMaxCached] = {};
  static std::mutex mutex;
  static std::map<int, DeviceInfo> others;
  bool const in_array = device >= 0 && device < kMaxCached;
  if (in_array && ready[device].load(std::memory_order_acquire)) { return cached[device]; }
  std::lock_guard<std::mutex> lock(mutex);
  if (!in_array) {
    auto const it = others.find(device);
    return it != others.end() ? it->second : others[device] = read_device_info(device);
  }
  if (!ready[device].load(std::memory_order_relaxed)) {
    cached[device] = read_device_info(device);
    ready[device].store(true, std::memory_order_release);
  }
  return cached[device];
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
