#pragma once

#include <optional>
#include <string>

namespace ddp {

/// The variable in which a launcher (ddp-launch, torchrun) names the file a failing worker writes its error to.
constexpr const char* kErrorFileEnv = "TORCHELASTIC_ERROR_FILE";

/// Writes `message` (one line: what went wrong, no backtrace) to the error file the launcher named in
/// TORCHELASTIC_ERROR_FILE, for the launcher to quote in its root-cause line: a message written just before dying
/// is then never lost in a buffered pipe. Call it where the program catches the error that ends it, before it
/// exits. The record is torchrun's JSON (docs/launcher.md, "Error files"), written to a temporary file that is
/// renamed over the path, so the launcher never reads half of one. Returns whether it was written; false when the
/// variable is unset or the file cannot be written. Never throws: it runs while failing.
bool record_error(const std::string& message) noexcept;

namespace detail {

/// The error record: {"message": {"message": M, "extraInfo": {"timestamp": "<unix seconds>"}}, "rank": R,
/// "restart_count": N}, torchrun's layout (its agent reads message.message) with the rank and restart it came from.
std::string error_record_json(const std::string& message, int rank, int restart_count, long long unix_seconds);

/// The message of an error file: "message" when it is a string, else "message"."message" (torchrun's layout); nullopt
/// when the file is missing, empty, not such JSON, or has no message.
std::optional<std::string> read_error_message(const std::string& path);

}  // namespace detail
}  // namespace ddp
