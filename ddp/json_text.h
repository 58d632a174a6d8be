#pragma once

// JSON values as text, for the few JSON files the library and its programs write (Chrome traces, metrics lines,
// benchmark results) without a JSON library.

#include <optional>
#include <string>

namespace ddp {

/// `text` as a JSON string literal, quotes included: '"' and '\' escaped, control characters as \n, \t or \u00XX.
/// Bytes from 0x80 up are copied (UTF-8 passes through).
std::string json_string(const std::string& text);

/// `value` as a JSON number (shortest text that reads back the same double), or null when it is absent or not
/// finite (JSON has no inf or NaN).
std::string json_number(const std::optional<double>& value);

}  // namespace ddp
