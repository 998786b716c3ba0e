// The trained heat surrogate in C++, without Python: model.ts (written by the study) loaded with LibTorch.
//
//     heat_predict OUTPUT_DIR/model.ts STEP INITIAL LEFT RIGHT BOTTOM TOP
//
// prints the predicted temperature field, one grid row per line. Build it against any LibTorch, e.g. the one
// inside the venv's torch: make predict (docs/how-to/use-the-model.md).
#include <torch/script.h>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s model.ts STEP INITIAL LEFT RIGHT BOTTOM TOP\n", argv[0]);
    return 2;
  }
  torch::jit::script::Module model;
  try {
    model = torch::jit::load(argv[1]);
  } catch (const c10::Error& error) {
    std::fprintf(stderr, "%s: cannot load %s: %s\n", argv[0], argv[1], error.what_without_backtrace());
    return 1;
  }
  float values[5];
  for (int i = 0; i < 5; ++i) values[i] = std::strtof(argv[3 + i], nullptr);
  // model.json's "inputs", in its order, each with the batch (here one question) first
  torch::Tensor parameters = torch::from_blob(values, {1, 5}, torch::kFloat32);
  torch::Tensor time_step = torch::full({1}, std::strtof(argv[2], nullptr), torch::kFloat32);
  torch::NoGradGuard no_grad;
  torch::Tensor field = model.forward({parameters, time_step}).toTensor()[0];  // [nx, ny], in kelvin
  for (int64_t i = 0; i < field.size(0); ++i) {
    for (int64_t j = 0; j < field.size(1); ++j) std::printf(j ? " %.4f" : "%.4f", field[i][j].item<float>());
    std::printf("\n");
  }
  return 0;
}
