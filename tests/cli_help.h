#pragma once

// Reading a CLI11 --help text in tests: what it says about one option.

#include <algorithm>
#include <sstream>
#include <string>

namespace test_util {

/// What a CLI11 --help text lists for `option` (one of its names, e.g. "--batch-size"): its line, with the type and
/// default CLI11 shows after the names ("--batch-size INT=128   ..."), and the description's continuation lines
/// (CLI11 starts the description on the next line after long names); empty when the help has no such option.
inline std::string option_help(const std::string& help, const std::string& option) {
  std::string found;
  for (size_t from = 0; from < help.size();) {
    const size_t end = std::min(help.find('\n', from), help.size());
    const std::string line = help.substr(from, end - from);
    from = end + 1;
    const size_t text_at = line.find_first_not_of(' ');
    const bool option_line = text_at != std::string::npos && line[text_at] == '-';
    if (!found.empty() && (option_line || text_at == std::string::npos)) return found;
    if (!found.empty()) {
      found += "\n" + line;
      continue;
    }
    if (!option_line) continue;
    // One of the line's names ("-h,--help", "--nproc-per-node,--nproc_per_node"), not a mention in a description.
    std::istringstream names(line.substr(text_at, line.find(' ', text_at) - text_at));
    for (std::string name; std::getline(names, name, ',');) {
      if (name == option) found = line;
    }
  }
  return found;
}

/// The default the help shows for `option`: "128" from "--batch-size INT=128", "O1" from
/// "--opt-level TEXT:{O0,O1,O2,O3}=O1"; empty when it shows none.
inline std::string default_shown(const std::string& help, const std::string& option) {
  std::istringstream line(option_help(help, option).substr(0, option_help(help, option).find('\n')));
  std::string names, type_and_default;
  line >> names >> type_and_default;
  const size_t equals = type_and_default.rfind('=');
  return equals == std::string::npos ? "" : type_and_default.substr(equals + 1);
}

}  // namespace test_util
