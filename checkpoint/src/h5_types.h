// Internal to the checkpoint library: HDF5 types of our dtypes, dataset name rules, attributes.
#pragma once

#include <hdf5.h>

#include <string>

#include "hpctrial/checkpoint/format.h"
#include "hpctrial/checkpoint/h5_handle.h"

namespace hpctrial::checkpoint::detail {

// The file type of `dtype` (little-endian IEEE and two's complement; float16 and bfloat16 as
// HDF5 float types with their bit layouts; bool as uint8). A new handle the caller owns.
H5Handle file_type(DType dtype);

// Whether `name` is a relative slash-separated path of non-empty components of letters,
// digits and "._-:" (not "." or ".."), at most 1024 characters.
bool is_valid_dataset_name(const std::string& name);

void write_string_attribute(hid_t object, const char* name, const std::string& value);
void write_uint_attribute(hid_t object, const char* name, std::uint64_t value);
// Throw CheckpointError naming `file` when the attribute is missing or of another kind.
std::string read_string_attribute(hid_t object, const char* name, const std::string& file);
std::uint64_t read_uint_attribute(hid_t object, const char* name, const std::string& file);

// Large datasets have their raw bytes written and read with direct I/O at their offset.
constexpr std::size_t kRawThreshold = 4096;
// Single reads and writes stay below this (HDF5 and some filesystems fail above 2 GiB).
constexpr std::size_t kMaxIo = std::size_t{1} << 30;

}  // namespace hpctrial::checkpoint::detail
