#pragma once

#include <string>

namespace torch::serialize {
class OutputArchive;
}  // namespace torch::serialize

namespace amp {

/// Replaces the file `path` with `bytes` so that anyone reading it, and anything that stops the writer at any
/// point (kill -9, a file-size limit, a full disk, a power cut after the call returned), finds either the old
/// file whole or the new one whole, never a mix or a truncated file: the bytes go to a temporary file in the same
/// folder (".NAME.tmp.XXXXXX"), which is flushed and fsynced, renamed over `path`, and the folder is fsynced.
/// An existing file's permission bits are kept; a new file gets 0644. On failure the temporary file is removed,
/// `path` is untouched, and std::runtime_error says which path and why (one line, no backtrace). A writer that
/// is killed mid-write may leave its temporary file behind; it never replaces `path`.
void write_file_atomically(const std::string& path, const std::string& bytes);

/// Serializes `archive` in memory and writes it to `path` with write_file_atomically.
void save_archive_atomically(torch::serialize::OutputArchive& archive, const std::string& path);

}  // namespace amp
