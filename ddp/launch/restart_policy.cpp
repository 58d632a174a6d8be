#include <ddp/launch/restart_policy.h>

#include <sstream>

namespace ddp::detail {

bool RestartBudget::record_failure(int attempt, const std::string& cause) {
  failures_.emplace_back(attempt, cause);
  if (restarts_ >= max_restarts_) return false;
  ++restarts_;
  return true;
}

std::string RestartBudget::restart_line() const {
  std::ostringstream out;
  out << "restart " << restarts_ << " of " << max_restarts_
      << " after: " << (failures_.empty() ? "" : failures_.back().second);
  return out.str();
}

std::string RestartBudget::give_up_summary(const std::string& prefix) const {
  if (max_restarts_ == 0) return "";
  std::ostringstream out;
  out << prefix << "gave up after " << restarts_ << " restart" << (restarts_ == 1 ? "" : "s") << " (--max-restarts "
      << max_restarts_ << "); the failures in order:\n";
  for (const auto& [attempt, cause] : failures_) out << prefix << "  attempt " << attempt << ": " << cause << "\n";
  return out.str();
}

}  // namespace ddp::detail
