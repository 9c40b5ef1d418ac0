// cnn_make_dataset: writes synthetic images for the cnn example.
//   cnn_make_dataset [DIR]   ->  DIR/train.h5 (4096 images), DIR/validation.h5 (1024)
#include <filesystem>
#include <iostream>

#include "synthetic_images.h"

int main(int argc, char** argv) {
  const std::filesystem::path dir = argc > 1 ? argv[1] : "data";
  try {
    std::filesystem::create_directories(dir);
    cnn_example::ImageSpec spec;
    cnn_example::write_synthetic_images((dir / "train.h5").string(), spec);
    spec.samples = 1024;
    spec.seed = 2;
    cnn_example::write_synthetic_images((dir / "validation.h5").string(), spec);
  } catch (const std::exception& e) {
    std::cerr << "cnn_make_dataset: " << e.what() << "\n";
    return 1;
  }
  std::cout << "wrote " << (dir / "train.h5").string() << " and " << (dir / "validation.h5").string() << "\n";
  return 0;
}
