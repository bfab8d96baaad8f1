// train_mlp.cpp — trains a small MLP pipelined over 3 CPU stages and checks it against the plain model.
//
// Runs with no arguments. Fits y = sin(x·w) on synthetic data with a
// 5-layer MLP cut into 3 stages and 4 micro-batches, prints the loss per
// step, verifies on the first step that every gradient equals the plain
// Sequential's (float64, 1e-10), and that training lowers the loss.
// Prints OK and exits 0, or says what differed and exits 1.
#include <gpipe/gpipe.h>

#include <torch/torch.h>

#include <cstdio>
#include <memory>

namespace {

torch::nn::Sequential make_mlp() {
  return torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::Tanh(),  //
                               torch::nn::Linear(64, 64), torch::nn::Tanh(),  //
                               torch::nn::Linear(64, 1));
}

}  // namespace

int main() {
  torch::manual_seed(0);
  torch::set_default_dtype(caffe2::TypeMeta::Make<double>());

  // Synthetic regression task.
  const auto x = torch::randn({256, 16});
  const auto w = torch::randn({16}) / 4.0;
  const auto y = torch::sin(x.matmul(w)).unsqueeze(1);

  auto model = make_mlp();
  auto plain = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
  gpipe::Pipe pipe(model, gpipe::PipeOptions().balance({2, 2, 1}).chunks(4));
  std::printf("gpipe example: %s\n", c10::str(*pipe).c_str());

  // First step: the pipeline's gradients must equal the plain model's.
  torch::mse_loss(pipe->forward(x), y).backward();
  torch::mse_loss(plain->forward(x), y).backward();
  const auto theirs = plain->named_parameters();
  double worst = 0.0;
  for (const auto& p : pipe->named_parameters()) {
    const double diff = (p.value().grad() - theirs[p.key()].grad()).abs().max().item<double>();
    if (diff > worst) worst = diff;
  }
  std::printf("first step: largest gradient difference to the plain Sequential: %.3g\n", worst);
  if (!(worst <= 1e-10)) {
    std::printf("FAILED: gradients differ from the plain Sequential by %.3g (> 1e-10)\n", worst);
    return 1;
  }

  torch::optim::Adam adam(pipe->parameters(), torch::optim::AdamOptions(1e-2));
  adam.zero_grad();
  double first = 0.0;
  double last = 0.0;
  const int steps = 40;
  for (int step = 0; step < steps; ++step) {
    auto loss = torch::mse_loss(pipe->forward(x), y);
    adam.zero_grad();
    loss.backward();
    adam.step();
    last = loss.item<double>();
    if (step == 0) first = last;
    std::printf("step %2d  loss %.5f\n", step, last);
  }
  if (!(last < 0.5 * first)) {
    std::printf("FAILED: loss went from %.5f to %.5f; expected it to halve\n", first, last);
    return 1;
  }
  std::printf("loss fell from %.5f to %.5f\nOK\n", first, last);
  return 0;
}
