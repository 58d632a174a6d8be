// amp::save_checkpoint / amp::load_checkpoint: the file format and every check made before anything changes.
//
// Note [checkpoint envelope]
// A checkpoint is one torch archive (a zip) holding, beside a format version, four entries, each stored as its
// serialized bytes (a uint8 tensor) with a 64-bit FNV-1a hash of those bytes beside it:
//   optimizer_type  the C++ type of the inner optimizer ("torch::optim::AdamW", "amp::FusedSGD")
//   model           State::save_model's archive (fp32 values, masters where they exist)
//   optimizer       the inner optimizer's own save()
//   amp             State::save's archive (options, every loss scaler)
// LibTorch's zip reader does not check the zip's CRCs and the tensors are stored uncompressed, so a flipped bit
// inside a tensor would load silently: the hashes catch it (FNV-1a changes with any change confined to one byte,
// so a single flipped bit is always caught). Everything is verified and parsed before the first write to model,
// optimizer or scalers. Files of format 1 (the three parts as nested archives, no hashes, no type) still load.
//
// Note [checkpoint extras]
// A caller may store named byte strings beside the three parts (amp::CheckpointExtras: the examples keep their
// training position and RNG state there, so a resume needs one file written atomically, not two). They are
// entries of the same envelope, hashed like the parts: "extras" lists the names, one per line, and extra NAME is
// the entry "extra_NAME". A file without "extras" has none. The format version stays 2: a reader that does not
// know extras ignores the entries, and files without them read as before.

#include <amp/amp.h>

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <exception>
#include <functional>
#include <iomanip>
#include <iterator>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/serialize/archive.h>

#include <amp/io/archive_error.h>
#include <amp/io/atomic_file.h>
#include <amp/zero/zero_shard.h>
#include <ddp/hash.h>

namespace amp::detail {
namespace {

constexpr int64_t kFormatVersion = 2;
constexpr int64_t kShardedIndexVersion = 3;  // Note [sharded checkpoint]: the index of a sharded ZeRO checkpoint
constexpr const char* kFormatKey = "format_version";
constexpr const char* kTypePart = "optimizer_type";
constexpr const char* kParts[] = {"model", "optimizer", "amp"};
constexpr const char* kExtrasPart = "extras";   // Note [checkpoint extras]
constexpr const char* kExtraPrefix = "extra_";  // extra NAME is the entry "extra_NAME"
constexpr size_t kMaxExtraNameLength = 64;

/// Throws a c10::Error carrying no backtrace: "checkpoint 'PATH': WHAT".
[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw c10::Error("checkpoint '" + path + "': " + one_line(what));
}

/// Runs `f`, re-reporting any exception as one line that names the file (and `context`, when given).
template <typename F>
auto checked(const std::string& path, const std::string& context, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    fail(path, context + exception_line(e));
  }
}

std::string hex(uint64_t value) {
  std::ostringstream out;
  out << "0x" << std::hex << std::setw(16) << std::setfill('0') << value;
  return out.str();
}

std::string type_name(const torch::optim::Optimizer& optimizer) { return c10::demangle(typeid(optimizer).name()); }

at::Tensor bytes_tensor(const std::string& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(t.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  return t;
}

std::string serialized(torch::serialize::OutputArchive& archive) {
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

void write_entry(torch::serialize::OutputArchive& all, const std::string& key, const std::string& bytes) {
  all.write(key + ".bytes", bytes_tensor(bytes));
  const uint64_t hash = ddp::fnv1a64(bytes.data(), bytes.size());
  int64_t stored = 0;
  std::memcpy(&stored, &hash, sizeof(stored));
  all.write(key + ".fnv1a64", at::tensor({stored}, at::kLong));
}

/// The bytes of entry `key` (contiguous uint8 on the CPU), verified against their stored hash.
at::Tensor read_entry(torch::serialize::InputArchive& all, const std::string& path, const std::string& key) {
  at::Tensor bytes, stored;
  if (!all.try_read(key + ".bytes", bytes) || !all.try_read(key + ".fnv1a64", stored)) {
    fail(path, "has no '" + key + "' part: the file was not written by amp::save_checkpoint or is damaged");
  }
  if (bytes.scalar_type() != at::kByte || bytes.dim() != 1 || stored.scalar_type() != at::kLong ||
      stored.numel() != 1) {
    fail(path, "its '" + key + "' part is malformed (" + std::string(c10::toString(bytes.scalar_type())) +
                   " bytes of shape " + c10::str(bytes.sizes()) + "): the file is damaged");
  }
  bytes = bytes.contiguous();
  const uint64_t computed = ddp::fnv1a64(bytes.data_ptr<uint8_t>(), static_cast<size_t>(bytes.numel()));
  const int64_t stored_value = stored.item<int64_t>();
  uint64_t expected = 0;
  std::memcpy(&expected, &stored_value, sizeof(expected));
  if (computed != expected) {
    fail(path, "its '" + key + "' part fails its checksum (FNV-1a " + hex(computed) + ", stored " + hex(expected) +
                   "): the file is corrupted");
  }
  return bytes;
}

std::string as_string(const at::Tensor& bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), static_cast<size_t>(bytes.numel()));
}

/// Whether `name` may name an extra: 1 to kMaxExtraNameLength characters of [A-Za-z0-9_-].
bool valid_extra_name(const std::string& name) {
  if (name.empty() || name.size() > kMaxExtraNameLength) return false;
  for (const char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

/// The extras of a format-2 file (none when it has no "extras" entry), every one verified against its hash.
CheckpointExtras read_extras(torch::serialize::InputArchive& all, const std::string& path) {
  CheckpointExtras extras;
  at::Tensor probe;
  if (!all.try_read(std::string(kExtrasPart) + ".bytes", probe)) return extras;
  std::istringstream names(as_string(read_entry(all, path, kExtrasPart)));
  for (std::string name; std::getline(names, name);) {
    if (!valid_extra_name(name)) fail(path, "its extras list names an invalid entry: the file is damaged");
    extras[name] = as_string(read_entry(all, path, kExtraPrefix + name));
  }
  return extras;
}

/// The three parts, parsed (format 2: verified first; format 1: nested archives).
struct Parts {
  torch::serialize::InputArchive model, optimizer, amp;
  std::string optimizer_type;  // empty for format 1
  CheckpointExtras extras;     // empty for format 1
};

void read_parts(const std::string& path, const c10::Device& device, Parts& parts) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) fail(path, std::string("cannot open it: ") + std::strerror(errno));
  if (S_ISDIR(info.st_mode)) fail(path, "it is a folder, not a checkpoint file");
  torch::serialize::InputArchive all;
  checked(path, "cannot read it as a checkpoint (" + std::to_string(info.st_size) + " bytes): ", [&] {
    all.load_from(path, c10::Device(c10::kCPU));
  });
  at::Tensor version;
  if (!all.try_read(kFormatKey, version)) {
    // Format 1: the parts as nested archives, without hashes.
    torch::serialize::InputArchive* targets[] = {&parts.model, &parts.optimizer, &parts.amp};
    for (size_t i = 0; i < std::size(kParts); ++i) {
      const bool found = checked(path, "", [&] { return all.try_read(kParts[i], *targets[i]); });
      if (!found) {
        fail(path, std::string("is not an amp checkpoint: it has neither a '") + kFormatKey + "' nor a '" + kParts[i] +
                       "' entry (write it with amp::save_checkpoint)");
      }
    }
    return;
  }
  if (version.numel() == 1 && version.scalar_type() == at::kLong && version.item<int64_t>() == kShardedIndexVersion) {
    fail(path,
         "is the index of a sharded ZeRO checkpoint (amp::save_checkpoint_sharded), larger than an index "
         "should be (its extras?): it loads only through amp::load_checkpoint in a run attached with a ZeroStage");
  }
  if (version.numel() != 1 || version.scalar_type() != at::kLong || version.item<int64_t>() != kFormatVersion) {
    fail(path, "has format version " +
                   (version.numel() == 1 ? std::to_string(version.item<int64_t>()) : "<malformed>") +
                   "; this build reads versions 1 and " + std::to_string(kFormatVersion));
  }
  // Verify every hash before parsing anything.
  parts.optimizer_type = as_string(read_entry(all, path, kTypePart));
  at::Tensor bytes[std::size(kParts)];
  for (size_t i = 0; i < std::size(kParts); ++i) bytes[i] = read_entry(all, path, kParts[i]);
  parts.extras = read_extras(all, path);
  torch::serialize::InputArchive* targets[] = {&parts.model, &parts.optimizer, &parts.amp};
  for (size_t i = 0; i < std::size(kParts); ++i) {
    checked(path, std::string("its '") + kParts[i] + "' part cannot be read: ", [&] {
      targets[i]->load_from(reinterpret_cast<const char*>(bytes[i].data_ptr<uint8_t>()),
                            static_cast<size_t>(bytes[i].numel()), device);
    });
  }
}

/// Puts back the optimizer state `before` (what save() wrote before a load was tried).
void restore_optimizer(State& state, torch::serialize::OutputArchive& before) {
  std::stringstream bytes;
  before.save_to(bytes);
  torch::serialize::InputArchive restore;
  restore.load_from(bytes);
  state.optimizer().load(restore);
}

void apply_loaded(State& state, std::vector<std::pair<at::Tensor, at::Tensor>>& model_copies, Parts& parts,
                  CheckpointExtras* extras);

// Note [sharded checkpoint]
// save_checkpoint_sharded writes, per rank r of N, "PATH.zero-G-r-of-N" (G: a generation id rank 0 draws for this
// save), an envelope of format kShardFormatVersion whose hashed "shard" entry is ShardedOwner::save_shard's archive
// (amp/state/shard_file.h: the rank's pieces by parameter name and element range, their masters and optimizer
// entries; ZeRO's pieces are slices of its buckets, full sharding's the parameters' parts in the rank's shard of each
// unit, and either loads the other's files). Once every rank has
// written its file, rank 0 writes the index at PATH: an envelope of format kShardedIndexVersion with the hashed
// entries "optimizer_type", "amp", "buffers" (the model's buffers) and "shards" (N, then the N file names), and the
// extras. Every file is written atomically and the index last, so PATH always names a complete set: a writer stopped
// before the index leaves the previous index and its files whole. Rank 0 then removes the files of the set it
// replaced. A load at any world size reads every shard file and takes what overlaps its own pieces.
constexpr int64_t kShardFormatVersion = 1;
constexpr const char* kShardFormatKey = "zero_shard_format_version";

/// An index holds amp's state, the model's buffers and the extras: far less than this. Larger files are not probed
/// (probing parses the whole archive, which a consolidated checkpoint would then pay twice).
constexpr off_t kLargestShardedIndexBytes = off_t{64} << 20;

bool is_sharded_index(const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0 || !S_ISREG(info.st_mode) || info.st_size > kLargestShardedIndexBytes) {
    return false;  // read_parts reports what is wrong with it
  }
  torch::serialize::InputArchive all;
  try {
    all.load_from(path, c10::Device(c10::kCPU));
  } catch (const std::exception&) {
    return false;  // read_parts reports what is wrong with it
  }
  at::Tensor version;
  return all.try_read(kFormatKey, version) && version.numel() == 1 && version.scalar_type() == at::kLong &&
         version.item<int64_t>() == kShardedIndexVersion;
}

void load_sharded(const std::string& path, State& state, ShardedOwner& sharded, CheckpointExtras* extras);

/// Reads and checks every part and loads the optimizer (restored if that fails); returns what applies the rest
/// (model values, amp state, extras): called at once unless `defer`.
std::function<void()> load_checked_parts(const std::string& path, State& state, CheckpointExtras* extras,
                                         bool defer = false);

}  // namespace

void save_checkpoint(const std::string& path, State& state, const CheckpointExtras& extras) {
  state.wait_for_parameters();  // Note [deferred publish]: the model as the last step() left it
  std::string extra_names;
  for (const auto& entry : extras) {
    if (!valid_extra_name(entry.first)) {
      fail(path, "cannot save it: extra '" + entry.first + "' is not a valid name (1 to " +
                     std::to_string(kMaxExtraNameLength) + " characters of A-Z, a-z, 0-9, '_', '-')");
    }
    extra_names += entry.first + "\n";
  }
  torch::serialize::OutputArchive model, optimizer, amp_state, all;
  ShardedOwner* const sharded = state.sharded_owner();
  checked(path, "cannot save it: ", [&] {
    state.save_model(model);  // ZeRO, full sharding: the values gathered from every rank (collective)
    if (sharded != nullptr) {
      sharded->save_consolidated_optimizer(optimizer);  // in the unsharded layout (collective)
    } else {
      state.optimizer().save(optimizer);
    }
    state.save(amp_state);
    all.write(kFormatKey, at::tensor({kFormatVersion}, at::kLong));
    write_entry(all, kTypePart, type_name(state.optimizer()));
    write_entry(all, "model", serialized(model));
    write_entry(all, "optimizer", serialized(optimizer));
    write_entry(all, "amp", serialized(amp_state));
    if (!extras.empty()) {
      write_entry(all, kExtrasPart, extra_names);
      for (const auto& [name, bytes] : extras) write_entry(all, kExtraPrefix + name, bytes);
    }
  });
  // Sharded: rank 0 writes the consolidated file, and every rank learns whether that worked.
  std::string failure;
  if (sharded == nullptr || sharded->rank() == 0) {
    try {
      save_archive_atomically(all, path);
    } catch (const std::exception& e) {
      failure = exception_line(e);  // write_file_atomically's message names the path already
      if (sharded == nullptr) throw c10::Error(failure);
    }
  }
  if (sharded != nullptr && sharded->count_failures(failure.empty()) > 0) {
    fail(path, failure.empty() ? std::string("rank 0 could not write it") : failure);
  }
}

void load_checkpoint(const std::string& path, State& state, CheckpointExtras* extras) {
  // Note [deferred publish]: a pending all-gather reads the send buffers the load rewrites and would overwrite the
  // loaded parameters.
  state.wait_for_parameters();
  ShardedOwner* const sharded = state.sharded_owner();
  if (is_sharded_index(path)) {
    if (sharded == nullptr) {
      fail(path,
           "is a sharded checkpoint (one file per rank): it loads into a run attached with a ZeroStage or a fully "
           "sharded model, at any world size. To get a file for a run without either, load it into one and save it "
           "with amp::save_checkpoint");
    }
    load_sharded(path, state, *sharded, extras);
    return;
  }
  if (sharded == nullptr) {
    load_checked_parts(path, state, extras);
    return;
  }
  // ZeRO, full sharding: every rank reads the (consolidated) file and takes its shard; a failure on any rank fails
  // every rank, and nothing changes anywhere (the optimizer is restored where it had been loaded).
  std::string failure;
  torch::serialize::OutputArchive before;
  state.optimizer().save(before);
  std::function<void()> apply;
  try {
    apply = load_checked_parts(path, state, extras, /*defer=*/true);
  } catch (const std::exception& e) {
    failure = exception_line(e);
  }
  const int64_t failed = sharded->count_failures(failure.empty());
  if (failed == 0) {
    apply();
    return;
  }
  if (failure.empty()) {  // another rank failed: undo the optimizer load here
    restore_optimizer(state, before);
    fail(path, std::to_string(failed) + " other rank(s) could not load it; nothing was changed");
  }
  throw c10::Error(failure);
}

namespace {

std::function<void()> load_checked_parts(const std::string& path, State& state, CheckpointExtras* extras, bool defer) {
  Parts parts;
  read_parts(path, state.device(), parts);
  const std::string loading = type_name(state.optimizer());
  if (!parts.optimizer_type.empty() && parts.optimizer_type != loading) {
    fail(path, "holds the state of an optimizer of type " + parts.optimizer_type +
                   " but is being loaded into one of type " + loading + ": build the optimizer it was saved with");
  }
  // Check model and amp parts without changing anything; then the optimizer, restored on failure; then apply.
  auto model_copies = checked(path, "", [&] { return state.prepare_model_load(parts.model); });
  checked(path, "", [&] { state.validate_amp_state(parts.amp); });
  torch::serialize::InputArchive sharded;  // ZeRO, full sharding: this rank's part of the unsharded optimizer state
  ShardedOwner* const owner = state.sharded_owner();
  torch::serialize::InputArchive& optimizer_part = owner != nullptr ? sharded : parts.optimizer;
  if (owner != nullptr) {
    const std::string bytes = checked(path, "its optimizer part does not fit this " + loading + ": ",
                                      [&] { return owner->shard_optimizer_archive(parts.optimizer); });
    sharded.load_from(bytes.data(), bytes.size(), state.device());
  }
  torch::serialize::OutputArchive before;
  state.optimizer().save(before);
  try {
    state.optimizer().load(optimizer_part);
  } catch (const std::exception& e) {
    const std::string why = exception_line(e);
    restore_optimizer(state, before);
    fail(path, "its optimizer part does not fit this " + loading + ": " + why);
  }
  auto shared = std::make_shared<Parts>(std::move(parts));
  auto copies = std::make_shared<decltype(model_copies)>(std::move(model_copies));
  std::function<void()> apply = [&state, extras, shared, copies] { apply_loaded(state, *copies, *shared, extras); };
  if (!defer) apply();
  return apply;
}

void apply_loaded(State& state, std::vector<std::pair<at::Tensor, at::Tensor>>& model_copies, Parts& parts,
                  CheckpointExtras* extras) {
  {
    at::NoGradGuard no_grad;
    for (auto& [dest, value] : model_copies) dest.copy_(value);
  }
  state.load(parts.amp);
  if (extras != nullptr) *extras = std::move(parts.extras);
}

std::string directory_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
}

std::string base_name(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

/// The shard file names an existing sharded index at `path` lists (empty when there is none or it is unreadable).
std::vector<std::string> listed_shards(const std::string& path) {
  std::vector<std::string> names;
  if (!is_sharded_index(path)) return names;
  try {
    torch::serialize::InputArchive all;
    all.load_from(path, c10::Device(c10::kCPU));
    std::istringstream lines(as_string(read_entry(all, path, "shards")));
    std::string line;
    std::getline(lines, line);  // the world size
    while (std::getline(lines, line)) names.push_back(line);
  } catch (const std::exception&) {
    names.clear();
  }
  return names;
}

void load_sharded(const std::string& path, State& state, ShardedOwner& sharded, CheckpointExtras* extras) {
  std::string failure;
  torch::serialize::OutputArchive before;
  state.optimizer().save(before);
  bool optimizer_loaded = false;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  torch::serialize::InputArchive amp_part;
  CheckpointExtras loaded_extras;
  try {
    torch::serialize::InputArchive index;
    checked(path, "cannot read it as a checkpoint: ", [&] { index.load_from(path, c10::Device(c10::kCPU)); });
    const std::string saved_type = as_string(read_entry(index, path, kTypePart));
    const std::string loading = type_name(state.optimizer());
    if (saved_type != loading) {
      fail(path, "holds the state of an optimizer of type " + saved_type + " but is being loaded into one of type " +
                     loading + ": build the optimizer it was saved with");
    }
    const at::Tensor amp_bytes = read_entry(index, path, "amp");
    checked(path, "its 'amp' part cannot be read: ", [&] {
      amp_part.load_from(reinterpret_cast<const char*>(amp_bytes.data_ptr<uint8_t>()),
                         static_cast<size_t>(amp_bytes.numel()), state.device());
    });
    checked(path, "", [&] { state.validate_amp_state(amp_part); });
    const at::Tensor buffer_bytes = read_entry(index, path, "buffers");
    torch::serialize::InputArchive buffers;
    checked(path, "its 'buffers' part cannot be read: ", [&] {
      buffers.load_from(reinterpret_cast<const char*>(buffer_bytes.data_ptr<uint8_t>()),
                        static_cast<size_t>(buffer_bytes.numel()), state.device());
    });
    for (const auto& b : state.module().named_buffers(true)) {
      at::Tensor value;
      if (!buffers.try_read(b.key(), value, /*is_buffer=*/true)) fail(path, "has no buffer '" + b.key() + "'");
      if (value.sizes() != b.value().sizes()) {
        fail(path, "has buffer '" + b.key() + "' with shape " + c10::str(value.sizes()) + " but the model's is " +
                       c10::str(b.value().sizes()));
      }
      copies.emplace_back(b.value(), value);
    }
    loaded_extras = read_extras(index, path);
    std::istringstream lines(as_string(read_entry(index, path, "shards")));
    std::string line;
    std::getline(lines, line);
    ShardLoad load = sharded.begin_shard_load();
    while (std::getline(lines, line)) {
      const std::string file = directory_of(path) + line;
      torch::serialize::InputArchive shard;
      checked(file,
              "cannot read this shard of '" + path + "': ", [&] { shard.load_from(file, c10::Device(c10::kCPU)); });
      at::Tensor version;
      if (!shard.try_read(kShardFormatKey, version) || version.numel() != 1 ||
          version.item<int64_t>() != kShardFormatVersion) {
        fail(file, "is not a shard of a sharded checkpoint this build reads (format " +
                       std::to_string(kShardFormatVersion) + ")");
      }
      const std::string bytes = as_string(read_entry(shard, file, "shard"));
      checked(file, "", [&] { sharded.read_shard(bytes, load); });
    }
    const std::string pieces = checked(path, "", [&] { return sharded.finish_shard_load(load, copies); });
    torch::serialize::InputArchive optimizer_part;
    optimizer_part.load_from(pieces.data(), pieces.size(), state.device());
    try {
      state.optimizer().load(optimizer_part);
      optimizer_loaded = true;
    } catch (const std::exception& e) {
      restore_optimizer(state, before);
      fail(path, "its optimizer state does not fit this " + loading + ": " + exception_line(e));
    }
  } catch (const std::exception& e) {
    failure = exception_line(e);
  }
  const int64_t failed = sharded.count_failures(failure.empty());
  if (failed > 0) {
    if (optimizer_loaded) restore_optimizer(state, before);
    if (!failure.empty()) throw c10::Error(failure);
    fail(path, std::to_string(failed) + " other rank(s) could not load it; nothing was changed");
  }
  {
    at::NoGradGuard no_grad;
    for (auto& [dest, value] : copies) dest.copy_(value);
  }
  state.load(amp_part);
  sharded.after_shard_load();  // ZeRO: every rank's loaded masters, rounded, into the model parameters
  if (extras != nullptr) *extras = std::move(loaded_extras);
}

}  // namespace

void save_checkpoint_sharded(const std::string& path, State& state, const CheckpointExtras& extras) {
  state.wait_for_parameters();                          // Note [deferred publish]
  ShardedOwner* const sharded = state.sharded_owner();  // ZeRO's or full sharding's
  if (sharded == nullptr) {
    fail(path,
         "save_checkpoint_sharded needs a run attached with a ZeroStage or a fully sharded model (each rank writes "
         "its shard); without either use amp::save_checkpoint");
  }
  std::string extra_names;
  for (const auto& entry : extras) {
    if (!valid_extra_name(entry.first)) fail(path, "cannot save it: extra '" + entry.first + "' is not a valid name");
    extra_names += entry.first + "\n";
  }
  // One generation id for the whole set, drawn by rank 0 (file names of different saves never mix).
  const int64_t generation = sharded->broadcast_from_root(
      static_cast<int64_t>(std::random_device()() ^ (static_cast<uint64_t>(::time(nullptr)) << 20)) & 0xffffffffffLL);
  const int world = static_cast<int>(sharded->count_failures(false));  // every rank counts itself: the world size
  auto shard_name = [&](int rank) {
    std::ostringstream name;
    name << base_name(path) << ".zero-" << std::hex << generation << std::dec << "-" << rank << "-of-" << world;
    return name.str();
  };
  std::string failure;
  try {
    torch::serialize::OutputArchive shard;
    shard.write(kShardFormatKey, at::tensor({kShardFormatVersion}, at::kLong));
    write_entry(shard, "shard", sharded->save_shard());
    save_archive_atomically(shard, directory_of(path) + shard_name(sharded->rank()));
  } catch (const std::exception& e) {
    failure = exception_line(e);
  }
  if (sharded->count_failures(failure.empty()) > 0) {
    if (!failure.empty()) throw c10::Error(failure);
    fail(path, "another rank could not write its shard; the previous checkpoint at this path is unchanged");
  }
  if (sharded->rank() == 0) {
    try {
      const std::vector<std::string> previous = listed_shards(path);
      torch::serialize::OutputArchive amp_state, buffers, all;
      state.save(amp_state);
      for (const auto& b : state.module().named_buffers(true)) buffers.write(b.key(), b.value().cpu(), true);
      std::string shards = std::to_string(world) + "\n";
      for (int r = 0; r < world; ++r) shards += shard_name(r) + "\n";
      all.write(kFormatKey, at::tensor({kShardedIndexVersion}, at::kLong));
      write_entry(all, kTypePart, type_name(state.optimizer()));
      write_entry(all, "amp", serialized(amp_state));
      write_entry(all, "buffers", serialized(buffers));
      write_entry(all, "shards", shards);
      if (!extras.empty()) {
        write_entry(all, kExtrasPart, extra_names);
        for (const auto& [name, bytes] : extras) write_entry(all, kExtraPrefix + name, bytes);
      }
      save_archive_atomically(all, path);
      for (const std::string& old : previous) {  // the replaced set: no longer reachable from the index
        bool kept = false;
        for (int r = 0; r < world; ++r) kept = kept || old == shard_name(r);
        if (!kept) std::remove((directory_of(path) + old).c_str());
      }
    } catch (const std::exception& e) {
      failure = exception_line(e);
    }
  }
  if (sharded->count_failures(failure.empty()) > 0) {
    if (!failure.empty()) throw c10::Error(failure);
    fail(path, "rank 0 could not write the index; the previous checkpoint at this path is unchanged");
  }
}

}  // namespace amp::detail

namespace amp {

void verify_checkpoint(const std::string& path) {
  detail::Parts parts;
  detail::read_parts(path, c10::Device(c10::kCPU), parts);
}

}  // namespace amp
