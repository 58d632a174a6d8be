#include <ddp/launch/text.h>

#include <sstream>

#include <c10/util/Exception.h>

namespace ddp::detail {

std::string seconds_value(std::chrono::milliseconds duration) {
  std::ostringstream out;
  out << static_cast<double>(duration.count()) / 1000.0;
  return out.str();
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
