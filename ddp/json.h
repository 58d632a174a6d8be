#pragma once

// The JSON the libraries and programs write and read (metrics lines, Chrome traces, benchmark results, the
// launcher's error files), with nlohmann-json. Internal: .cpp files include it, no installed header does, and it is
// not installed (nlohmann-json is a build dependency only).

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace ddp {

/// A JSON document whose members keep the order they were added in (files read by people as well as programs).
using Json = nlohmann::ordered_json;

/// `value` as a JSON number, or null when it is not finite (JSON has no inf or NaN).
inline Json json_number(double value) { return std::isfinite(value) ? Json(value) : Json(nullptr); }

/// `value` as a JSON number, or null when it is absent or not finite.
inline Json json_number(const std::optional<double>& value) { return value ? json_number(*value) : Json(nullptr); }

/// `value` as a JSON integer, or null when it is absent.
inline Json json_number(const std::optional<int64_t>& value) { return value ? Json(*value) : Json(nullptr); }

/// `value` as text: one line (indent < 0) or indented. Bytes that are not UTF-8 (a message from the system, a path)
/// become U+FFFD instead of failing the write.
inline std::string json_text(const Json& value, int indent = -1) {
  return value.dump(indent, ' ', false, Json::error_handler_t::replace);
}

}  // namespace ddp
