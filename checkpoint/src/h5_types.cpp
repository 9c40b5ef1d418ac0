#include "h5_types.h"

#include <cstring>
#include <regex>

#include "hpctrial/core/error.h"

namespace hpctrial::checkpoint::detail {
namespace {

H5Handle float_type(std::size_t sign_pos, std::size_t exp_pos, std::size_t exp_size, std::size_t mant_size,
                    std::size_t bias) {
  H5Handle type(H5Tcopy(H5T_IEEE_F32LE), "H5Tcopy");
  check_h5(H5Tset_fields(type.get(), sign_pos, exp_pos, exp_size, 0, mant_size), "H5Tset_fields");
  check_h5(H5Tset_size(type.get(), 2), "H5Tset_size");
  check_h5(H5Tset_precision(type.get(), 16), "H5Tset_precision");
  check_h5(H5Tset_ebias(type.get(), bias), "H5Tset_ebias");
  return type;
}

}  // namespace

H5Handle file_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return H5Handle(H5Tcopy(H5T_IEEE_F32LE), "H5Tcopy");
    case DType::kFloat64: return H5Handle(H5Tcopy(H5T_IEEE_F64LE), "H5Tcopy");
    case DType::kFloat16: return float_type(15, 10, 5, 10, 15);
    case DType::kBFloat16: return float_type(15, 7, 8, 7, 127);
    case DType::kInt64: return H5Handle(H5Tcopy(H5T_STD_I64LE), "H5Tcopy");
    case DType::kInt32: return H5Handle(H5Tcopy(H5T_STD_I32LE), "H5Tcopy");
    case DType::kInt16: return H5Handle(H5Tcopy(H5T_STD_I16LE), "H5Tcopy");
    case DType::kInt8: return H5Handle(H5Tcopy(H5T_STD_I8LE), "H5Tcopy");
    case DType::kUInt8:
    case DType::kBool: return H5Handle(H5Tcopy(H5T_STD_U8LE), "H5Tcopy");
  }
  throw InternalError("file_type: unknown dtype");
}

bool is_valid_dataset_name(const std::string& name) {
  static const std::regex component("[A-Za-z0-9_.:-]+");
  if (name.empty() || name.size() > 1024) return false;
  std::size_t start = 0;
  while (true) {
    const std::size_t end = name.find('/', start);
    const std::string part = name.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (part.empty() || part == "." || part == ".." || !std::regex_match(part, component)) return false;
    if (end == std::string::npos) return true;
    start = end + 1;
  }
}

void write_string_attribute(hid_t object, const char* name, const std::string& value) {
  H5Handle type(H5Tcopy(H5T_C_S1), "H5Tcopy");
  check_h5(H5Tset_size(type.get(), value.empty() ? 1 : value.size()), "H5Tset_size");
  H5Handle space(H5Screate(H5S_SCALAR), "H5Screate");
  H5Handle attribute(H5Acreate2(object, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT),
                     std::string("creating attribute ") + name);
  const std::string padded = value.empty() ? std::string(1, '\0') : value;
  check_h5(H5Awrite(attribute.get(), type.get(), padded.data()), std::string("writing attribute ") + name);
}

void write_uint_attribute(hid_t object, const char* name, std::uint64_t value) {
  H5Handle space(H5Screate(H5S_SCALAR), "H5Screate");
  H5Handle attribute(H5Acreate2(object, name, H5T_STD_U64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT),
                     std::string("creating attribute ") + name);
  check_h5(H5Awrite(attribute.get(), H5T_NATIVE_UINT64, &value), std::string("writing attribute ") + name);
}

std::string read_string_attribute(hid_t object, const char* name, const std::string& file) {
  if (H5Aexists(object, name) <= 0) throw CheckpointError(file + ": attribute '" + name + "' is missing");
  H5Handle attribute(H5Aopen(object, name, H5P_DEFAULT), std::string("opening attribute ") + name);
  H5Handle type(H5Aget_type(attribute.get()), "H5Aget_type");
  if (H5Tget_class(type.get()) != H5T_STRING || H5Tis_variable_str(type.get()) > 0) {
    throw CheckpointError(file + ": attribute '" + name + "' is not a fixed-length string");
  }
  const std::size_t size = H5Tget_size(type.get());
  if (size == 0 || size > (1u << 20)) throw CheckpointError(file + ": attribute '" + name + "' has an absurd size");
  std::string value(size, '\0');
  check_h5(H5Aread(attribute.get(), type.get(), value.data()), std::string("reading attribute ") + name);
  value.resize(std::strlen(value.c_str()));
  return value;
}

std::uint64_t read_uint_attribute(hid_t object, const char* name, const std::string& file) {
  if (H5Aexists(object, name) <= 0) throw CheckpointError(file + ": attribute '" + name + "' is missing");
  H5Handle attribute(H5Aopen(object, name, H5P_DEFAULT), std::string("opening attribute ") + name);
  H5Handle type(H5Aget_type(attribute.get()), "H5Aget_type");
  H5Handle space(H5Aget_space(attribute.get()), "H5Aget_space");
  if (H5Tget_class(type.get()) != H5T_INTEGER || H5Sget_simple_extent_npoints(space.get()) != 1) {
    throw CheckpointError(file + ": attribute '" + name + "' is not an integer");
  }
  std::uint64_t value = 0;
  check_h5(H5Aread(attribute.get(), H5T_NATIVE_UINT64, &value), std::string("reading attribute ") + name);
  return value;
}

}  // namespace hpctrial::checkpoint::detail
