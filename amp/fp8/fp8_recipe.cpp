#include <amp/fp8/fp8_recipe.h>

#include <sstream>

#include <c10/util/Exception.h>

namespace amp {
namespace {

const char* scaling_name(Fp8Scaling s) { return s == Fp8Scaling::kDelayed ? "delayed" : "current"; }
const char* format_name(Fp8Format f) { return f == Fp8Format::kHybrid ? "hybrid" : "e4m3"; }
const char* amax_name(Fp8AmaxCompute a) { return a == Fp8AmaxCompute::kMax ? "max" : "most_recent"; }

}  // namespace

void Fp8Recipe::check() const {
  TORCH_CHECK(amax_history_len() >= 1 && amax_history_len() <= (int64_t{1} << 20),
              "amp::Fp8Recipe: amax_history_len must be in [1, 1048576], got ", amax_history_len());
  TORCH_CHECK(margin() >= 0 && margin() < 64, "amp::Fp8Recipe: margin must be in [0, 63], got ", margin());
}

std::string Fp8Recipe::to_string() const {
  std::ostringstream out;
  out << "scaling=" << scaling_name(scaling()) << ",format=" << format_name(format())
      << ",history=" << amax_history_len() << ",margin=" << margin() << ",amax=" << amax_name(amax_compute());
  return out.str();
}

c10::ScalarType Fp8Recipe::dtype(int role) const {
  return role == kFp8GradOutput && format() == Fp8Format::kHybrid ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn;
}

}  // namespace amp
