#pragma once

#include <string>

namespace amp {

/// LibTorch's message for a torch archive (a zip) it could not read, cut to what happened. PyTorchStreamReader's
/// errors run to 300+ characters, mostly a paragraph of advice ("PytorchStreamReader failed reading zip archive:
/// failed finding central directory. This is an internal miniz error. If you are seeing this error, ..."); they
/// become "damaged or truncated zip archive (failed finding central directory)" when the archive could not be
/// opened, "unreadable zip archive (locating file data/0: file not found)" for a failure inside it. Whatever comes
/// before the reader's part is kept; any other message is returned unchanged.
std::string short_archive_error(const std::string& message);

}  // namespace amp
