#include "hpctrial/core/error.h"

#include <cstring>

namespace hpctrial::core {

void throw_errno(const std::string& what, int err) {
  char buffer[256];
  // GNU strerror_r returns the message, which may or may not live in buffer.
  const char* text = strerror_r(err, buffer, sizeof buffer);
  throw IoError(what + ": " + text);
}

void enforce_failed(const char* file, int line, const char* condition, const std::string& detail) {
  std::string message = std::string("internal error at ") + file + ":" + std::to_string(line) +
                        ": expected " + condition;
  if (!detail.empty()) message += " " + detail;
  message += "; this is a bug in hpctrial, please report it with this message";
  throw InternalError(message);
}

}  // namespace hpctrial::core
