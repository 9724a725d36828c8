#pragma once

// The error messages' pieces, formatted as Python prints them. Numbers are formatted here, never streamed (the
// extension's own ostream integer insertion crashes on the H200 image).

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

namespace flash_epilogue {

std::string num(int64_t v);
std::string num(c10::IntArrayRef v);  // as a tuple
// As Python prints a tuple ((), (3,), (2, 3); '*' at index `star`) or, with `list`, a list.
std::string seq(c10::IntArrayRef v, int64_t star = -1, bool list = false);
std::string hex_str(int64_t v);  // Python's f"{v:#x}"
std::string repr(double v);      // Python's repr of a float: the shortest round trip
std::string dtype_name(at::ScalarType t);
std::string rank_got(at::Tensor const& t);  // "<n> dims, shape (...)"
int64_t address(at::Tensor const& t);

}  // namespace flash_epilogue
