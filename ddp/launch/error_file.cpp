#include <ddp/launch/error_file.h>

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>

#include <ddp/json.h>

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
  // torchelastic's layout: the message and a timestamp (a string of unix seconds) under "message".
  const Json record = {
      {"message", {{"message", message}, {"extraInfo", {{"timestamp", std::to_string(unix_seconds)}}}}},
      {"rank", rank},
      {"restart_count", restart_count}};
  return json_text(record) + "\n";
}

std::optional<std::string> read_error_message(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // {"message": "..."} or torchelastic's {"message": {"message": "...", ...}}; anything else has none.
  const Json record = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!record.is_object() || !record.contains("message")) return std::nullopt;
  const Json* message = &record["message"];
  if (message->is_object()) {
    if (!message->contains("message")) return std::nullopt;
    message = &(*message)["message"];
  }
  if (!message->is_string() || message->get_ref<const std::string&>().empty()) return std::nullopt;
  return message->get<std::string>();
}

}  // namespace detail
}  // namespace ddp
