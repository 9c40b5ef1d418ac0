// PNG encoding through libpng, into memory.
#include <png.h>

#include <csetjmp>

#include "hpctrial/core/error.h"
#include "hpctrial/tensorboard/event_writer.h"

namespace hpctrial::tensorboard {

namespace {

void append(png_structp png, png_bytep data, png_size_t size) {
  auto* out = static_cast<std::string*>(png_get_io_ptr(png));
  out->append(reinterpret_cast<const char*>(data), size);
}

void no_flush(png_structp) {}

// libpng reports errors by longjmp to the setjmp below; its message is kept for the exception.
void on_error(png_structp png, png_const_charp message) {
  auto* text = static_cast<std::string*>(png_get_error_ptr(png));
  *text = message;
  png_longjmp(png, 1);
}

void on_warning(png_structp, png_const_charp) {}

int color_type(int channels) {
  switch (channels) {
    case 1: return PNG_COLOR_TYPE_GRAY;
    case 3: return PNG_COLOR_TYPE_RGB;
    case 4: return PNG_COLOR_TYPE_RGBA;
    default: throw InternalError("encode_png: an image has 1, 3 or 4 channels, not " + std::to_string(channels));
  }
}

}  // namespace

std::string encode_png(const Image& image) {
  color_type(image.channels);  // refuses other channel counts before libpng starts
  if (image.height <= 0 || image.width <= 0 ||
      image.pixels.size() != static_cast<std::size_t>(image.height) * image.width * image.channels) {
    throw InternalError("encode_png: " + std::to_string(image.pixels.size()) + " bytes for a " +
                        std::to_string(image.height) + "x" + std::to_string(image.width) + "x" +
                        std::to_string(image.channels) + " image");
  }
  std::string out;
  std::string error;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &error, on_error, on_warning);
  if (png == nullptr) throw InternalError("encode_png: libpng could not start");
  png_infop info = png_create_info_struct(png);
  if (info == nullptr || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    throw InternalError("encode_png: " + (error.empty() ? std::string("libpng failed") : error));
  }
  png_set_write_fn(png, &out, append, no_flush);
  png_set_IHDR(png, info, static_cast<png_uint_32>(image.width), static_cast<png_uint_32>(image.height), 8,
               color_type(image.channels),
               PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  const std::size_t row_bytes = static_cast<std::size_t>(image.width) * image.channels;
  for (int row = 0; row < image.height; ++row) {
    png_write_row(png, const_cast<png_bytep>(image.pixels.data() + row * row_bytes));
  }
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return out;
}

}  // namespace hpctrial::tensorboard
