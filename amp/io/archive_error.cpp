#include <amp/io/archive_error.h>

#include <c10/util/Exception.h>

namespace amp {
namespace {

// PyTorchStreamReader::valid() (caffe2/serialize/inline_container.cc) writes
// "PytorchStreamReader failed <what><info>: <miniz's reason>" followed by its advice.
constexpr const char* kReaderFailed = "PytorchStreamReader failed ";
constexpr const char* kMinizAdvice = ". This is an internal miniz error";
constexpr const char* kOpeningArchive = "reading zip archive: ";  // the archive could not be opened at all

}  // namespace

std::string short_archive_error(const std::string& message) {
  const size_t start = message.find(kReaderFailed);
  if (start == std::string::npos) return message;
  std::string reason = message.substr(start + std::char_traits<char>::length(kReaderFailed));
  reason = reason.substr(0, reason.find(kMinizAdvice));
  reason = reason.substr(0, reason.find('\n'));
  const std::string opening = kOpeningArchive;
  if (reason.rfind(opening, 0) == 0) {
    return message.substr(0, start) + "damaged or truncated zip archive (" + reason.substr(opening.size()) + ")";
  }
  return message.substr(0, start) + "unreadable zip archive (" + reason + ")";
}

std::string one_line(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\n') {
      while (!out.empty() && out.back() == ' ') out.pop_back();
      if (!out.empty()) out += "; ";
      while (i + 1 < text.size() && (text[i + 1] == ' ' || text[i + 1] == '\n')) ++i;
    } else {
      out += text[i];
    }
  }
  return out;
}

std::string exception_line(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) return one_line(short_archive_error(error->msg()));
  return one_line(short_archive_error(e.what()));
}

}  // namespace amp
