// custom_module.cpp — a custom Module whose forward chains submodules (MNIST-style) as a Pipe, checked.
//
// Runs with no arguments. The Net is written the usual LibTorch way:
// registered submodules (conv1, conv2, conv2_drop, fc1, fc2) and a forward
// with functional steps between them (max_pool2d, relu, a view to
// (-1, 320), dropout, log_softmax). `as_sequential` lists the same
// submodule objects in the forward's order, with a torch::nn::Functional
// for each functional step, and the Sequential runs as 3 CPU stages of 4
// micro-batches. In float64 the Pipe's outputs and, after backward of the
// same loss, every parameter's grad must equal the Net's own (1e-10): in
// eval mode, and in training mode with dropout 0 (dropout's masks differ
// in a pipeline; see docs/custom_modules.md). Then a few training steps
// through the Pipe must lower the loss and train the Net itself, whose
// checkpoint keeps the Net's keys. Prints OK and exits 0, or says what
// differed and exits 1. docs/custom_modules.md walks through it.
#include <gpipe/gpipe.h>

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <unordered_map>

namespace {

// A digit classifier for 1x28x28 images, as LibTorch users write one.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(double dropout = 0.5) : dropout(dropout) {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 10, 5)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(10, 20, 5)));
    conv2_drop = register_module("conv2_drop", torch::nn::Dropout2d(dropout));
    fc1 = register_module("fc1", torch::nn::Linear(320, 50));
    fc2 = register_module("fc2", torch::nn::Linear(50, 10));
  }

  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv1(x), 2));              // [N, 10, 12, 12]
    x = torch::relu(torch::max_pool2d(conv2_drop(conv2(x)), 2));  // [N, 20, 4, 4]
    x = x.view({-1, 320});
    x = torch::relu(fc1(x));
    x = torch::dropout(x, dropout, is_training());
    return torch::log_softmax(fc2(x), /*dim=*/1);
  }

  double dropout;
  torch::nn::Conv2d conv1{nullptr};
  torch::nn::Conv2d conv2{nullptr};
  torch::nn::Dropout2d conv2_drop{nullptr};
  torch::nn::Linear fc1{nullptr};
  torch::nn::Linear fc2{nullptr};
};
TORCH_MODULE(Net);

// The Net's forward as a Sequential: its own submodules (the same objects,
// so the parameters are shared, not copied) in the order forward calls
// them, and a Functional for each step between. Every layer is its own
// object (a Pipe refuses one module twice), hence a fresh Functional for
// each max_pool2d and relu. The functional dropout, which reads the Net's
// is_training(), becomes a Dropout module, which follows the Pipe's
// train() and eval().
torch::nn::Sequential as_sequential(const Net& net) {
  using torch::nn::Functional;
  auto pool = [] { return Functional([](torch::Tensor x) { return torch::max_pool2d(x, 2); }); };
  return torch::nn::Sequential(
      net->conv1, pool(), Functional(torch::relu),                                    // 0-2
      net->conv2, net->conv2_drop, pool(), Functional(torch::relu),                   // 3-6
      Functional([](torch::Tensor x) { return x.view({-1, 320}); }),                  // 7
      net->fc1, Functional(torch::relu), torch::nn::Dropout(net->dropout),            // 8-10
      net->fc2, Functional([](torch::Tensor x) { return torch::log_softmax(x, 1); }));  // 11-12
}

// The Pipe's name for each of the Net's parameters and buffers
// ("conv1.weight" -> "0.weight"): they are the same tensors.
std::map<std::string, std::string> pipe_names(torch::nn::Module& net, torch::nn::Module& pipe) {
  std::unordered_map<const c10::TensorImpl*, std::string> in_pipe;
  for (const auto& p : pipe.named_parameters()) in_pipe[p.value().unsafeGetTensorImpl()] = p.key();
  for (const auto& b : pipe.named_buffers()) in_pipe[b.value().unsafeGetTensorImpl()] = b.key();
  std::map<std::string, std::string> names;
  for (const auto& p : net.named_parameters()) {
    names[p.key()] = in_pipe.at(p.value().unsafeGetTensorImpl());
  }
  for (const auto& b : net.named_buffers()) {
    names[b.key()] = in_pipe.at(b.value().unsafeGetTensorImpl());
  }
  return names;
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

struct Diffs {
  double output = 0.0;
  double grad = 0.0;
};

// Runs the Net, keeps its grads of the loss, zeroes them (the Pipe's
// parameters are the same tensors), runs the Pipe, compares.
Diffs compare(Net& net, gpipe::Pipe& pipe, const torch::Tensor& x, const torch::Tensor& labels) {
  net->zero_grad();
  const auto want = net->forward(x);
  torch::nll_loss(want, labels).backward();
  std::map<std::string, torch::Tensor> want_grads;
  for (const auto& p : net->named_parameters()) want_grads[p.key()] = p.value().grad().clone();
  net->zero_grad();

  const auto got = pipe->forward(x);
  torch::nll_loss(got, labels).backward();
  Diffs diffs;
  diffs.output = max_diff(got, want);
  const auto names = pipe_names(*net, *pipe);
  const auto params = pipe->named_parameters();
  for (const auto& [name, grad] : want_grads) {
    diffs.grad = std::max(diffs.grad, max_diff(params[names.at(name)].grad(), grad));
  }
  return diffs;
}

bool report(const char* what, const Diffs& diffs) {
  std::printf("%s: largest difference to the Net: outputs %.3g, grads %.3g\n", what, diffs.output,
              diffs.grad);
  const bool ok = diffs.output <= 1e-10 && diffs.grad <= 1e-10;
  if (!ok) std::printf("FAILED: %s: the Pipe differs from the Net by more than 1e-10\n", what);
  return ok;
}

}  // namespace

int main() {
  torch::manual_seed(0);
  torch::set_default_dtype(caffe2::TypeMeta::Make<double>());

  // 64 synthetic "digits": a fixed random pattern per class plus noise.
  const auto labels = torch::arange(64, torch::kLong) % 10;
  const auto patterns = torch::randn({10, 1, 28, 28});
  const auto x = patterns.index_select(0, labels) + 0.5 * torch::randn({64, 1, 28, 28});

  // 13 layers in 3 stages on the CPU, 4 micro-batches of 16 rows.
  const auto options = gpipe::PipeOptions()
                           .balance({4, 4, 5})
                           .devices({torch::kCPU, torch::kCPU, torch::kCPU})
                           .chunks(4);
  Net net;
  gpipe::Pipe pipe(as_sequential(net), options);
  std::printf("gpipe example: %s\n", c10::str(*pipe).c_str());
  std::string renamed;
  for (const auto& [ours, theirs] : pipe_names(*net, *pipe)) renamed += " " + ours + "->" + theirs;
  std::printf("the Net's parameters in the Pipe:%s\n", renamed.c_str());

  // Eval mode: no dropout, nothing checkpointed (grads still flow).
  bool ok = true;
  net->eval();
  pipe->eval();
  ok &= report("eval mode", compare(net, pipe, x, labels));

  // Training mode, checkpointing micro-batches 0-2 (Checkpoint::ExceptLast),
  // on a Net with dropout 0 so that both draw the same (no) masks.
  {
    Net plain(/*dropout=*/0.0);
    gpipe::Pipe piped(as_sequential(plain), options);
    ok &= report("training mode, dropout 0", compare(plain, piped, x, labels));
  }
  if (!ok) return 1;

  // Training through the Pipe, dropout on: the optimizer takes the Pipe's
  // parameters, which are the Net's.
  pipe->train();
  torch::optim::Adam adam(pipe->parameters(), torch::optim::AdamOptions(5e-3));
  double first = 0.0;
  double last = 0.0;
  const int steps = 30;
  for (int step = 0; step < steps; ++step) {
    auto loss = torch::nll_loss(pipe->forward(x), labels);
    adam.zero_grad();
    loss.backward();
    adam.step();
    last = loss.item<double>();
    if (step == 0) first = last;
    std::printf("step %2d  loss %.4f\n", step, last);
  }
  if (!(last < 0.5 * first)) {
    std::printf("FAILED: loss went from %.4f to %.4f; expected it to halve\n", first, last);
    return 1;
  }

  // The Net was trained with it: its checkpoint (the Net's own keys) loads
  // into a fresh Net that computes what the Pipe computes.
  std::stringstream checkpoint;
  torch::save(net, checkpoint);
  Net loaded;
  torch::load(loaded, checkpoint);
  loaded->eval();
  pipe->eval();
  torch::NoGradGuard no_grad;
  const double trained = max_diff(loaded->forward(x), pipe->forward(x));
  std::printf("loss fell from %.4f to %.4f; the Net's saved and reloaded weights match the Pipe's "
              "outputs to %.3g\n", first, last, trained);
  if (!(trained <= 1e-10)) {
    std::printf("FAILED: the reloaded Net differs from the Pipe by %.3g (> 1e-10)\n", trained);
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
