// Errors a user can act on. Expected failures (bad files, bad arguments,
// oversized requests) throw kvserve::Error with a one-line message naming the
// problem; broken internal invariants use assert.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace kvserve {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <class... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace kvserve
