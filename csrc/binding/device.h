#pragma once

// The devices: what this build has code for, and what a device is (read once per device).

#include <string>
#include <utility>
#include <vector>

namespace flash_epilogue {

std::vector<std::string> const& compiled_archs();  // "sm_90a", or "sm_80" and "sm_90a"
bool compiled_for(char const* arch);
// Whether this build has kernels for a GPU of this compute capability: an sm_90 GPU with sm_90a code, an sm_8x GPU
// with sm_80 code.
bool has_kernels(std::pair<int, int> capability);
std::pair<int, int> device_capability(int device);  // (major, minor)
int multiprocessor_count(int device);
// Once per host thread and device: a thread without a CUDA runtime call has no current context (c10's guard skips
// cudaSetDevice for a matching index), and encoding the TMA descriptors there crashes (docs/design.md).
void bind_primary_context(int device);

}  // namespace flash_epilogue
