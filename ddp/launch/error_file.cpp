#include <ddp/launch/error_file.h>

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>

namespace ddp {
namespace {

/// The whole of an environment variable as a non-negative integer, or `fallback`.
int env_int(const char* name, int fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  return *end == '\0' && value >= 0 && value <= 1 << 30 ? static_cast<int>(value) : fallback;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
      out += escaped;
    } else {
      out += ch;  // UTF-8 passes through as it is
    }
  }
  return out + "\"";
}

/// Just enough of a JSON reader to find a string member: values are skipped, strings decoded.
class JsonReader {
 public:
  explicit JsonReader(const std::string& text) : text_(text) {}

  /// At an object: its member "message" when that is a string, else the string "message" inside it; nullopt
  /// when there is neither or the text is not such JSON.
  std::optional<std::string> message() {
    std::optional<std::string> found;
    if (!object([&](const std::string& key) {
          if (key != "message") return skip_value();
          space();
          if (peek() == '"') {
            std::string value;
            if (!string(value)) return false;
            found = value;
            return true;
          }
          if (peek() == '{') {
            std::optional<std::string> inner;
            const bool ok = object([&](const std::string& inner_key) {
              if (inner_key != "message" || peek_after_space() != '"') return skip_value();
              std::string value;
              space();
              if (!string(value)) return false;
              inner = value;
              return true;
            });
            found = inner;
            return ok;
          }
          return skip_value();
        })) {
      return std::nullopt;
    }
    return found;
  }

 private:
  char peek() const { return at_ < text_.size() ? text_[at_] : '\0'; }
  char peek_after_space() {
    space();
    return peek();
  }
  void space() {
    while (at_ < text_.size() && (text_[at_] == ' ' || text_[at_] == '\n' || text_[at_] == '\r' || text_[at_] == '\t'))
      ++at_;
  }
  bool take(char c) {
    space();
    if (peek() != c) return false;
    ++at_;
    return true;
  }

  template <typename Member>
  bool object(const Member& member) {
    if (!take('{')) return false;
    if (take('}')) return true;
    do {
      space();
      std::string key;
      if (!string(key) || !take(':') || !member(key)) return false;
    } while (take(','));
    return take('}');
  }

  static void append_utf8(std::string& out, unsigned code) {
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xC0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else if (code < 0x10000) {
      out += static_cast<char>(0xE0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (code >> 18));
      out += static_cast<char>(0x80 | ((code >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    }
  }

  bool hex4(unsigned& code) {
    if (at_ + 4 > text_.size()) return false;
    code = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[at_++];
      code <<= 4;
      if (c >= '0' && c <= '9')
        code |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f')
        code |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        code |= static_cast<unsigned>(c - 'A' + 10);
      else
        return false;
    }
    return true;
  }

  bool string(std::string& out) {
    if (peek() != '"') return false;
    ++at_;
    while (at_ < text_.size()) {
      const char c = text_[at_++];
      if (c == '"') return true;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_ >= text_.size()) return false;
      const char e = text_[at_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out += e;
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          unsigned code = 0;
          if (!hex4(code)) return false;
          if (code >= 0xD800 && code < 0xDC00 && text_.compare(at_, 2, "\\u") == 0) {  // a surrogate pair
            at_ += 2;
            unsigned low = 0;
            if (!hex4(low)) return false;
            code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
          }
          append_utf8(out, code);
          break;
        }
        default:
          return false;
      }
    }
    return false;
  }

  bool skip_value() {
    space();
    const char c = peek();
    if (c == '"') {
      std::string ignored;
      return string(ignored);
    }
    if (c == '{') return object([&](const std::string&) { return skip_value(); });
    if (c == '[') {
      ++at_;
      if (take(']')) return true;
      do {
        if (!skip_value()) return false;
      } while (take(','));
      return take(']');
    }
    const size_t start = at_;  // a number, true, false or null
    while (at_ < text_.size() && std::string(",}] \n\r\t").find(text_[at_]) == std::string::npos) ++at_;
    return at_ > start;
  }

  const std::string& text_;
  size_t at_ = 0;
};

}  // namespace

bool record_error(const std::string& message) noexcept {
  try {
    const char* path = std::getenv(kErrorFileEnv);
    if (path == nullptr || *path == '\0') return false;
    const long long now =
        std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
    const std::string record =
        detail::error_record_json(message, env_int("RANK", 0), env_int("TORCHELASTIC_RESTART_COUNT", 0), now);
    const std::string temporary = std::string(path) + ".tmp." + std::to_string(::getpid());
    {
      std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
      out << record;
      out.flush();
      if (!out) {
        std::remove(temporary.c_str());
        return false;
      }
    }
    if (std::rename(temporary.c_str(), path) != 0) {
      std::remove(temporary.c_str());
      return false;
    }
    return true;
  } catch (...) {
    return false;
  }
}

namespace detail {

std::string error_record_json(const std::string& message, int rank, int restart_count, long long unix_seconds) {
  std::ostringstream out;
  out << "{\"message\": {\"message\": " << json_string(message) << ", \"extraInfo\": {\"timestamp\": \"" << unix_seconds
      << "\"}}, \"rank\": " << rank << ", \"restart_count\": " << restart_count << "}\n";
  return out.str();
}

std::optional<std::string> read_error_message(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::optional<std::string> message = JsonReader(text).message();
  if (message && message->empty()) return std::nullopt;
  return message;
}

}  // namespace detail
}  // namespace ddp
