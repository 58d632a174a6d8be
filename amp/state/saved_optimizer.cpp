#include <amp/state/saved_optimizer.h>

#include <sstream>
#include <string>

namespace amp::detail {

void read_back_saved_state(const torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& in) {
  torch::serialize::OutputArchive own;
  optimizer.save(own);
  std::ostringstream bytes;
  own.save_to(bytes);
  const std::string text = bytes.str();
  in.load_from(text.data(), text.size());
}

}  // namespace amp::detail
