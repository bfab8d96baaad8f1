// consumer.cpp — uses the installed umbrella header and library: prints a checkpoint mode, a balance, its C++ standard and whether gpipe makes Gloo groups.
#include <gpipe/gpipe.h>  // the only gpipe header: it must bring every public one

#include <torch/nn/modules/linear.h>

#include <iostream>

int main() {
  auto options = gpipe::PipeOptions().balance({1, 1}).chunks(2).checkpoint(gpipe::Checkpoint::Always);
  // 110, 2 and 2 parameters: the big layer alone is the best 2-way split.
  torch::nn::Sequential model(torch::nn::Linear(10, 10), torch::nn::Linear(1, 1),
                              torch::nn::Linear(1, 1));
  const auto balance = gpipe::balance_by_params(2, model);
  std::cout << gpipe::to_string(options.checkpoint()) << " balance";
  for (auto layers : balance) std::cout << " " << layers;
  // The standard this file was compiled as (the headers serve C++17 and 20),
  // and whether the library can make a Gloo group with no Python.
  std::cout << " c++" << (__cplusplus >= 202002L ? 20 : 17) << " gloo "
            << (gpipe::distributed::has_backend("gloo") ? "yes" : "no") << "\n";
  return options.chunks() == 2 ? 0 : 1;
}
