#pragma once

#include <exception>
#include <string>

namespace amp {

/// LibTorch's message for a torch archive (a zip) it could not read, cut to what happened. PyTorchStreamReader's
/// errors run to 300+ characters, mostly a paragraph of advice ("PytorchStreamReader failed reading zip archive:
/// failed finding central directory. This is an internal miniz error. If you are seeing this error, ..."); they
/// become "damaged or truncated zip archive (failed finding central directory)" when the archive could not be
/// opened, "unreadable zip archive (locating file data/0: file not found)" for a failure inside it. Whatever comes
/// before the reader's part is kept; any other message is returned unchanged.
std::string short_archive_error(const std::string& message);

/// One line: newlines (LibTorch's multi-line messages) become "; ".
std::string one_line(const std::string& text);

/// The message of an exception as one line, without a C++ backtrace (c10::Error::what() carries one) and without the
/// zip reader's paragraph of advice (short_archive_error).
std::string exception_line(const std::exception& e);

}  // namespace amp
