#include "hpctrial/checkpoint/h5_handle.h"

#include <utility>

#include "hpctrial/core/error.h"
#include "hpctrial/core/logging.h"

namespace hpctrial::checkpoint {
namespace {

herr_t collect(unsigned depth, const H5E_error2_t* error, void* data) {
  auto* text = static_cast<std::string*>(data);
  if (depth > 0) text->append("; ");
  text->append(error->desc != nullptr && error->desc[0] != '\0' ? error->desc : "(no description)");
  if (error->func_name != nullptr) {
    text->append(" (in ");
    text->append(error->func_name);
    text->append(")");
  }
  return 0;
}

herr_t close_id(hid_t id) {
  switch (H5Iget_type(id)) {
    case H5I_FILE: return H5Fclose(id);
    case H5I_GROUP: return H5Gclose(id);
    case H5I_DATASET: return H5Dclose(id);
    case H5I_DATASPACE: return H5Sclose(id);
    case H5I_DATATYPE: return H5Tclose(id);
    case H5I_ATTR: return H5Aclose(id);
    case H5I_GENPROP_LST: return H5Pclose(id);
    default: return H5Idec_ref(id) < 0 ? -1 : 0;
  }
}

}  // namespace

std::mutex& h5_mutex() {
  static std::mutex mutex;
  return mutex;
}

void silence_h5_errors() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

std::string h5_error_stack() {
  std::string text;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, collect, &text);
  H5Eclear2(H5E_DEFAULT);
  return text.empty() ? "no HDF5 error details" : text;
}

herr_t check_h5(herr_t status, const std::string& what) {
  if (status < 0) throw CheckpointError(what + ": " + h5_error_stack());
  return status;
}

hid_t check_h5_id(hid_t id, const std::string& what) {
  if (id < 0) throw CheckpointError(what + ": " + h5_error_stack());
  return id;
}

H5Handle::H5Handle(hid_t id, const std::string& what) : id_(check_h5_id(id, what)) {}

H5Handle::~H5Handle() {
  if (id_ < 0) return;
  if (close_id(id_) < 0) {
    core::log_warning("closing an HDF5 object failed: {}", h5_error_stack());
  }
}

H5Handle::H5Handle(H5Handle&& other) noexcept : id_(std::exchange(other.id_, H5I_INVALID_HID)) {}

H5Handle& H5Handle::operator=(H5Handle&& other) noexcept {
  if (this != &other) {
    H5Handle old(std::move(*this));
    id_ = std::exchange(other.id_, H5I_INVALID_HID);
  }
  return *this;
}

void H5Handle::close() {
  if (id_ < 0) return;
  const hid_t id = std::exchange(id_, H5I_INVALID_HID);
  check_h5(close_id(id), "closing an HDF5 object");
}

}  // namespace hpctrial::checkpoint
