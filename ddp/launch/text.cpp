#include <ddp/launch/text.h>

#include <string>

#include <c10/util/Exception.h>

namespace ddp::detail {

std::string seconds_value(std::chrono::milliseconds duration) {
  // Exact to the millisecond and independent of the locale (a double through a stream keeps 6 digits).
  const long long ms = duration.count();
  const char* sign = ms < 0 ? "-" : "";
  const long long magnitude = ms < 0 ? -ms : ms;
  std::string fraction = std::to_string(magnitude % 1000);
  fraction = std::string(3 - fraction.size(), '0') + fraction;
  while (!fraction.empty() && fraction.back() == '0') fraction.pop_back();
  return sign + std::to_string(magnitude / 1000) + (fraction.empty() ? "" : "." + fraction);
}

std::string id_list(const std::vector<int>& ids) {
  std::string list;
  for (const int id : ids) list += (list.empty() ? "" : ",") + std::to_string(id);
  return list;
}

std::string message_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) return error->what_without_backtrace();
  return e.what();
}

}  // namespace ddp::detail
