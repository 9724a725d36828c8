// The error messages' pieces (format.h).

#include "format.h"

#include <array>
#include <charconv>

namespace flash_epilogue {

namespace {

template <class... A>
std::string chars(A... a) {  // std::to_chars(a...) as a string
  std::array<char, 32> buf;
  return std::string(buf.data(), std::to_chars(buf.data(), buf.data() + buf.size(), a...).ptr);
}

}  // namespace

std::string num(int64_t v) { return std::to_string(v); }

std::string seq(c10::IntArrayRef v, int64_t star, bool list) {
  std::string s = list ? "[" : "(";
  for (size_t i = 0; i < v.size(); ++i) {
    s += (i ? ", " : "") + (static_cast<int64_t>(i) == star ? std::string("'*'") : std::to_string(v[i]));
  }
  return s + (list ? "]" : v.size() == 1 ? ",)" : ")");
}

std::string num(c10::IntArrayRef v) { return seq(v); }
std::string hex_str(int64_t v) { return "0x" + chars(static_cast<uint64_t>(v), 16); }
std::string repr(double v) { return chars(v); }
std::string dtype_name(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }
std::string rank_got(at::Tensor const& t) { return num(t.dim()) + " dims, shape " + num(t.sizes()); }
int64_t address(at::Tensor const& t) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.const_data_ptr())); }

}  // namespace flash_epilogue
