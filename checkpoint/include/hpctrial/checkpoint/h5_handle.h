// RAII ownership of HDF5 identifiers, and the checked wrapper for HDF5 calls.
//
// H5Handle owns one hid_t (file, group, dataset, dataspace, datatype, attribute or property
// list) and closes it with the matching H5*close when it goes out of scope. Move-only; the
// destructor never throws (a failed close is logged).
//
// check_h5(status, "what") turns a negative HDF5 return into CheckpointError carrying the
// HDF5 error stack (most specific message first), so a user sees "unable to open file: file
// signature not found" rather than a bare -1. HDF5's own printing of the stack to stderr is
// switched off by silence_h5_errors(), which every entry point of this library calls.
//
// Thread safety: as thread-safe as the HDF5 library it links (Debian's is not built
// thread-safe: use HDF5 from one thread at a time).
#pragma once

#include <hdf5.h>

#include <mutex>
#include <string>

namespace hpctrial::checkpoint {

// Debian's HDF5 is not built thread-safe: every use of the library (checkpoint writers, data
// readers on prefetch threads) holds this lock.
std::mutex& h5_mutex();

// Turns off HDF5's automatic printing of error stacks (idempotent).
void silence_h5_errors();

// The current HDF5 error stack as text, innermost first; clears it.
std::string h5_error_stack();

// Throws CheckpointError("<what>: <HDF5 error stack>") when status is negative.
herr_t check_h5(herr_t status, const std::string& what);
// For calls returning identifiers: throws when id is negative, else returns it.
hid_t check_h5_id(hid_t id, const std::string& what);

class H5Handle {
 public:
  H5Handle() = default;
  // Takes ownership of `id`; throws CheckpointError naming `what` when id < 0.
  H5Handle(hid_t id, const std::string& what);
  ~H5Handle();
  H5Handle(H5Handle&& other) noexcept;
  H5Handle& operator=(H5Handle&& other) noexcept;
  H5Handle(const H5Handle&) = delete;
  H5Handle& operator=(const H5Handle&) = delete;

  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  // Closes now and reports a failed close as CheckpointError (for the publication path,
  // where a close that fails means data did not reach the file).
  void close();

 private:
  hid_t id_ = H5I_INVALID_HID;
};

}  // namespace hpctrial::checkpoint
