#pragma once

// What every program of the project does with a bad command line: one line on stderr naming what is wrong. Header
// only (CLI11 and fmt), so that the benchmarks that do not link the examples' library share it.

#include <cctype>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

namespace examples {

/// `message` as one printable line: a LibTorch backtrace nested in it ("Exception raised from ... frame #0")
/// is cut, line breaks become "; ", and bytes outside printable ASCII are written as \xNN.
inline std::string one_line(const std::string& message) {
  // LibTorch appends its backtrace to what(); a message that embeds another error's what() carries it along.
  std::string text = message.substr(0, message.find("\nException raised from"));
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  std::string out;
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte == '\n') {
      out += "; ";
    } else if (byte == '\t') {
      out += ' ';
    } else if (byte < 0x20 || byte >= 0x7f) {
      out += fmt::format("\\x{:02x}", byte);
    } else {
      out += c;
    }
  }
  return out;
}

/// Parses the command line into `app`'s options. Returns nullopt to go on; otherwise the exit status: 0 after
/// --help (printed on stdout), non-zero after a bad command line, reported as one line on stderr
/// ("program: message (see --help)"); unknown flags are named in command-line order.
inline std::optional<int> parse_flags(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    const std::string program = argc > 0 ? argv[0] : app.get_name();
    const size_t slash = program.rfind('/');
    std::string message = one_line(e.what());
    if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
      // CLI11 lists the extras last first ("x --what 1 --bogus"); name the unknown flags in command-line order, and
      // only the arguments when no flag is unknown.
      std::vector<std::string> flags, arguments;
      for (const std::string& arg : app.remaining()) {
        const bool is_flag = arg.size() > 1 && arg[0] == '-' && !std::isdigit(static_cast<unsigned char>(arg[1]));
        (is_flag ? flags : arguments).push_back(arg);
      }
      message = flags.empty() ? fmt::format("unexpected argument{} {}", arguments.size() > 1 ? "s" : "",
                                            fmt::join(arguments, " "))
                              : fmt::format("unknown flag{} {}", flags.size() > 1 ? "s" : "", fmt::join(flags, ", "));
    }
    std::fprintf(stderr, "%s: %s (see --help)\n", program.substr(slash == std::string::npos ? 0 : slash + 1).c_str(),
                 message.c_str());
    return e.get_exit_code() != 0 ? e.get_exit_code() : 2;
  }
  return std::nullopt;
}

}  // namespace examples
