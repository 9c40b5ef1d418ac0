// mlp_make_dataset: writes a synthetic training and validation file for the mlp example.
//   mlp_make_dataset [DIR]   ->  DIR/train.h5 (8192 samples), DIR/validation.h5 (2048)
#include <filesystem>
#include <iostream>

#include "synthetic_data.h"

int main(int argc, char** argv) {
  const std::filesystem::path dir = argc > 1 ? argv[1] : "data";
  try {
    std::filesystem::create_directories(dir);
    mlp_example::SyntheticSpec spec;
    mlp_example::write_synthetic_dataset((dir / "train.h5").string(), spec);
    spec.samples = 2048;
    spec.seed = 2;
    mlp_example::write_synthetic_dataset((dir / "validation.h5").string(), spec);
  } catch (const std::exception& e) {
    std::cerr << "mlp_make_dataset: " << e.what() << "\n";
    return 1;
  }
  std::cout << "wrote " << (dir / "train.h5").string() << " and " << (dir / "validation.h5").string() << "\n";
  return 0;
}
