#include <ddp/json_text.h>

#include <charconv>
#include <cmath>
#include <cstdio>

namespace ddp {

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string json_number(const std::optional<double>& value) {
  if (!value || !std::isfinite(*value)) return "null";
  char digits[32];
  const auto written = std::to_chars(digits, digits + sizeof digits, *value);  // the shortest that reads back
  return std::string(digits, written.ptr);
}

}  // namespace ddp
