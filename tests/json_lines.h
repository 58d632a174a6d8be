#pragma once

// The JSON the programs write (metrics lines, Chrome traces, error records, benchmark results), parsed: a test checks
// the values, not how they are spelled.

#include <cstddef>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace test_json {

using Json = nlohmann::ordered_json;

/// `text` parsed; a text that is not JSON fails the calling test and gives a discarded value.
inline Json parse(const std::string& text) {
  Json value = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(value.is_discarded()) << "not JSON: " << text;
  return value;
}

/// The lines of `text` (JSON lines) whose "type" is `type`, or every line when `type` is empty; each must parse.
inline std::vector<Json> lines_of_type(const std::string& text, const std::string& type = "") {
  std::vector<Json> out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    Json value = parse(line);
    if (type.empty() || (value.is_object() && value.value("type", "") == type)) out.push_back(std::move(value));
  }
  return out;
}

/// The number `key` of `object`, or NaN when it is null or absent.
inline double number(const Json& object, const std::string& key) {
  const auto found = object.find(key);
  if (found == object.end() || !found->is_number()) return std::numeric_limits<double>::quiet_NaN();
  return found->get<double>();
}

/// How many members of `array` have `key` equal to `value` (Chrome trace events by name, for example).
inline size_t count_where(const Json& array, const std::string& key, const std::string& value) {
  size_t n = 0;
  for (const Json& item : array) n += item.is_object() && item.value(key, "") == value ? 1 : 0;
  return n;
}

}  // namespace test_json
