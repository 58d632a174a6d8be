#include <run/training_checkpoint.h>

#include <stdexcept>
#include <utility>

#include <amp/io/archive_error.h>
#include <amp/io/atomic_file.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

namespace run {

void save_training_checkpoint(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                              const RunState& state) {
  torch::serialize::OutputArchive archive, model_archive, optimizer_archive, run_archive;
  module.save(model_archive);
  optimizer.save(optimizer_archive);
  write_run_state(run_archive, state);
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("run_state", run_archive);
  amp::save_archive_atomically(archive, path);
}

std::optional<RunState> load_training_checkpoint(const std::string& path, torch::nn::Module& module,
                                                 torch::optim::Optimizer& optimizer) {
  torch::serialize::InputArchive archive, model_archive, optimizer_archive;
  try {
    archive.load_from(path);
  } catch (const c10::Error& e) {
    throw std::runtime_error("cannot read it as a checkpoint: " + amp::short_archive_error(e.what_without_backtrace()));
  }
  for (const auto& [key, part] : {std::pair<const char*, torch::serialize::InputArchive*>{"model", &model_archive},
                                  {"optimizer", &optimizer_archive}}) {
    if (!archive.try_read(key, *part)) {
      throw std::runtime_error(std::string("no '") + key +
                               "' part: not a checkpoint of a model and its optimizer (run::save_training_checkpoint)");
    }
  }
  std::optional<RunState> state;
  torch::serialize::InputArchive run_archive;
  if (archive.try_read("run_state", run_archive)) state = read_run_state(run_archive);  // absent in older files
  module.load(model_archive);
  optimizer.load(optimizer_archive);
  return state;
}

}  // namespace run
