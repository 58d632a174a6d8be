#pragma once

#include <chrono>
#include <exception>
#include <string>
#include <vector>

namespace ddp::detail {

/// Small pieces of the launcher's messages and environment values, shared by ddp-launch, ddp::spawn and the
/// process group.

/// A duration as seconds, as a flag or variable takes it: 1500 ms -> "1.5".
std::string seconds_value(std::chrono::milliseconds duration);

/// Node ids as a flag lists them: {0, 2} -> "0,2".
std::string id_list(const std::vector<int>& ids);

/// An exception's message; c10::Error's without its C++ backtrace, which would bury the sentence that matters.
std::string message_of(const std::exception& e);

}  // namespace ddp::detail
