// DEFT_CHECK(cond, fmt, ...): an invariant, false only through a bug (bad input is validated and
// answered with a Status before it gets this far). A failed check aborts in every build with one
// message format: "check failed at FILE:LINE: COND: MESSAGE". DEFT_FAIL(fmt, ...) is the same
// without a condition, for a branch that cannot be reached.
#pragma once

#include <cstdarg>
#include <cstdio>
#include <cstdlib>

namespace deft::detail {

[[noreturn]] __attribute__((format(printf, 4, 5))) inline void check_failed(
    const char* condition, const char* file, int line, const char* format, ...) {
  std::fprintf(stderr, "check failed at %s:%d: %s: ", file, line, condition);
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fputc('\n', stderr);
  std::fflush(stderr);
  std::abort();
}

}  // namespace deft::detail

#define DEFT_CHECK(condition, ...)                                               \
  do {                                                                           \
    if (!(condition)) {                                                          \
      ::deft::detail::check_failed(#condition, __FILE__, __LINE__, __VA_ARGS__); \
    }                                                                            \
  } while (0)

#define DEFT_FAIL(...) ::deft::detail::check_failed("unreachable", __FILE__, __LINE__, __VA_ARGS__)
