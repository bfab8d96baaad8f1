// test_balance.cpp — the exact partitioner against brute force; balancing by params, time and size.
#include <gpipe/balance.h>
#include <gpipe/pipe.h>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <random>
#include <thread>

namespace {

// Every split of n layers into k non-empty stages, in lexicographic order of
// the balance; the first one with the smallest bottleneck.
std::vector<int64_t> brute_force(const std::vector<double>& costs, int64_t k) {
  const auto n = static_cast<int64_t>(costs.size());
  std::vector<int64_t> best;
  double best_cost = 1e300;
  std::vector<int64_t> current;
  std::function<void(int64_t, int64_t)> go = [&](int64_t start, int64_t left) {
    if (left == 0) {
      if (start != n) return;
      double worst = 0;
      int64_t i = 0;
      for (int64_t part : current) {
        double sum = 0;
        for (int64_t e = i; e < i + part; ++e) sum += costs[static_cast<size_t>(e)];
        worst = std::max(worst, sum);
        i += part;
      }
      if (worst < best_cost) {
        best_cost = worst;
        best = current;
      }
      return;
    }
    for (int64_t part = 1; start + part <= n - (left - 1); ++part) {
      current.push_back(part);
      go(start + part, left - 1);
      current.pop_back();
    }
  };
  go(0, k);
  return best;
}

struct SleepImpl : torch::nn::Module {
  explicit SleepImpl(int ms) : ms(ms) {}
  torch::Tensor forward(torch::Tensor x) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return x * 1;
  }
  int ms;
};
TORCH_MODULE(Sleep);

// Sleeps `ms`, and `extra_ms` more on its second run (the first one
// balance_by_time times): a time slice lost to another process.
struct HiccupImpl : torch::nn::Module {
  HiccupImpl(int ms, int extra_ms) : ms(ms), extra_ms(extra_ms) {}
  torch::Tensor forward(torch::Tensor x) {
    ++runs;
    std::this_thread::sleep_for(std::chrono::milliseconds(ms + (runs == 2 ? extra_ms : 0)));
    return x * 1;
  }
  int ms, extra_ms, runs = 0;
};
TORCH_MODULE(Hiccup);

// Its to() moves like a copy to another device would: fresh storage. Each
// forward logs, per probe, 'M' if that probe's parameter is away from its
// own storage, '.' if home; so a test sees what profiling had moved.
struct ProbeImpl : torch::nn::Module {
  ProbeImpl(std::vector<ProbeImpl*>* probes, std::vector<std::string>* log)
      : probes(probes), log(log) {
    w = register_parameter("w", torch::ones({1}));
    home = w.data_ptr();
  }
  using torch::nn::Module::to;
  void to(torch::Device device, bool non_blocking) override {
    torch::NoGradGuard no_grad;
    w.set_data(w.detach().clone());
    torch::nn::Module::to(device, non_blocking);
  }
  torch::Tensor forward(torch::Tensor x) {
    std::string moved;
    for (auto* p : *probes) moved += p->w.data_ptr() == p->home ? '.' : 'M';
    log->push_back(moved);
    return x * w;
  }
  std::vector<ProbeImpl*>* probes;
  std::vector<std::string>* log;
  torch::Tensor w;
  const void* home;
};
TORCH_MODULE(Probe);

// Takes and returns {float activations, int64 ids}: sleeps, scales the
// floats by its parameter's first element, passes the ids on.
struct PairImpl : torch::nn::Module {
  PairImpl(int ms, int64_t params) : ms(ms) { w = register_parameter("w", torch::ones({params})); }
  std::vector<torch::Tensor> forward(std::vector<torch::Tensor> xs) {
    TORCH_CHECK(xs.size() == 2 && xs[1].scalar_type() == torch::kLong && !xs[1].requires_grad());
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return {xs[0] * w[0], xs[1]};
  }
  int ms;
  torch::Tensor w;
};
TORCH_MODULE(Pair);

struct JoinImpl : torch::nn::Module {
  torch::Tensor forward(std::vector<torch::Tensor> xs) {
    return xs[0] + xs[1].to(xs[0].scalar_type()).unsqueeze(1);
  }
};
TORCH_MODULE(Join);

}  // namespace

TEST_CASE("balance: the partitioner equals brute force on random costs", "[balance]") {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 12);
    const int k = 1 + static_cast<int>(rng() % std::min(5, n));
    std::vector<double> costs;
    // Small integers: many ties, all sums exact.
    for (int i = 0; i < n; ++i) costs.push_back(static_cast<double>(rng() % 6));
    INFO("trial " << trial << " n=" << n << " k=" << k);
    CHECK(gpipe::balance_cost(costs, k) == brute_force(costs, k));
  }
}

TEST_CASE("balance: partitioner literal cases and refusals", "[balance]") {
  CHECK(gpipe::balance_cost({1, 1, 1, 1}, 2) == std::vector<int64_t>{2, 2});
  CHECK(gpipe::balance_cost({10, 1, 1, 1}, 2) == std::vector<int64_t>{1, 3});
  CHECK(gpipe::balance_cost({1, 1, 1, 10}, 2) == std::vector<int64_t>{3, 1});
  CHECK(gpipe::balance_cost({5}, 1) == std::vector<int64_t>{1});
  CHECK_THROWS_WITH(gpipe::balance_cost({1, 2, 3}, 4),
                    Catch::Contains("3 layers into 4 stages"));
  CHECK_THROWS_WITH(gpipe::balance_cost({1, 2, 3}, 0), Catch::Contains("got 0"));
  CHECK_THROWS_WITH(gpipe::balance_cost({1, -2, 3}, 2), Catch::Contains("layer 1 is -2"));
}

TEST_CASE("balance: by params puts a big layer alone", "[balance]") {
  torch::nn::Sequential model(torch::nn::Linear(4, 4), torch::nn::ReLU(),
                              torch::nn::Linear(4, 200), torch::nn::Linear(200, 4),
                              torch::nn::ReLU());
  // Params: 20, 0, 1000, 804, 0.
  CHECK(gpipe::balance_by_params(2, model) == std::vector<int64_t>{3, 2});
  // {1, 2, 2} and {2, 1, 2} both cost 1000; ties go to the lexicographically
  // smallest balance.
  CHECK(gpipe::balance_by_params(3, model) == std::vector<int64_t>{1, 2, 2});
}

TEST_CASE("balance: by time gives a 10x slower layer a stage of its own", "[balance]") {
  torch::nn::Sequential model(Sleep(2), Sleep(2), Sleep(20), Sleep(2), Sleep(2), Sleep(2));
  auto balance = gpipe::balance_by_time(3, model, torch::ones({4, 3}),
                                        gpipe::BalanceOptions().timeout(0.3));
  CHECK(balance == std::vector<int64_t>{2, 1, 3});
}

TEST_CASE("balance: by time shrugs off one slow run", "[balance]") {
  // Layer 0 loses 0.3 s in its first timed run: timed once, it would look
  // like the slowest layer, giving {1, 2}.
  torch::nn::Sequential model(Hiccup(10, 300), Sleep(10), Sleep(40));
  CHECK(gpipe::balance_by_time(2, model, torch::ones({2, 2}), gpipe::BalanceOptions().timeout(0)) ==
        std::vector<int64_t>{2, 1});
}

TEST_CASE("balance: profiling holds one layer on the device at a time", "[balance]") {
  std::vector<ProbeImpl*> probes;
  std::vector<std::string> log;
  torch::nn::Sequential model;
  for (int i = 0; i < 4; ++i) {
    Probe probe(&probes, &log);
    probes.push_back(probe.get());
    model->push_back(probe);
  }
  gpipe::balance_by_time(2, model, torch::ones({4, 3}), gpipe::BalanceOptions().timeout(0));
  const size_t timed = log.size();
  gpipe::balance_by_size(2, model, torch::ones({4, 3}));
  // Warm-up and kMinRepeats timed rounds, then one run each by size.
  CHECK(timed == 4 * (1 + gpipe::kMinRepeats));
  REQUIRE(log.size() == timed + 4);
  const std::vector<std::string> expected{"M...", ".M..", "..M.", "...M"};
  for (size_t i = 0; i < log.size(); ++i) CHECK(log[i] == expected[i % 4]);
  for (auto* p : probes) CHECK(p->w.data_ptr() == p->home);
}

TEST_CASE("balance: layers that take and return several tensors", "[balance]") {
  const std::vector<torch::Tensor> sample{torch::randn({16, 8}), torch::arange(16)};
  torch::nn::Sequential timed(Pair(5, 1), Pair(5, 1), Pair(50, 1), Pair(5, 1), Join());
  CHECK(gpipe::balance_by_time(3, timed, sample, gpipe::BalanceOptions().timeout(0)) ==
        std::vector<int64_t>{2, 1, 2});
  // Two layers of 16 KiB parameters (x2) and small ones: the big two apart.
  torch::nn::Sequential sized(Pair(0, 4096), Pair(0, 4096), Pair(0, 8), Pair(0, 8), Join());
  CHECK(gpipe::balance_by_size(2, sized, sample, gpipe::BalanceOptions().chunks(4)) ==
        std::vector<int64_t>{1, 4});
  torch::nn::Sequential bad(torch::nn::Linear(2, 2));
  CHECK_THROWS_WITH(gpipe::balance_by_size(1, bad, std::vector<torch::Tensor>{}),
                    Catch::Contains("empty list of tensors"));
}

TEST_CASE("balance: by size splits the heaviest layer from its heavy neighbour", "[balance]") {
  torch::nn::Sequential model(torch::nn::Linear(16, 512), torch::nn::Linear(512, 512),
                              torch::nn::Linear(512, 512), torch::nn::Linear(512, 16));
  auto balance = gpipe::balance_by_size(2, model, torch::ones({8, 16}),
                                        gpipe::BalanceOptions().chunks(2));
  CHECK(balance == std::vector<int64_t>{2, 2});
  // Activations count too: a layer keeping a huge activation stands alone.
  torch::nn::Sequential wide(torch::nn::Linear(16, 16), torch::nn::Linear(16, 4096),
                             torch::nn::Tanh(), torch::nn::Linear(4096, 16));
  auto sizes = gpipe::balance_by_size(3, wide, torch::ones({64, 16}),
                                      gpipe::BalanceOptions().param_scale(0.0));
  // Layers 1 and 2 (1 MiB of output each) must land in different stages.
  CHECK((sizes == std::vector<int64_t>{1, 1, 2} || sizes == std::vector<int64_t>{2, 1, 1}));
}

TEST_CASE("balance: profiling leaves the model as it found it", "[balance]") {
  torch::nn::Sequential model(torch::nn::Linear(6, 6), torch::nn::BatchNorm1d(6),
                              torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)),
                              torch::nn::Linear(6, 2), torch::nn::Tanh());
  model->eval();
  model[0]->as<torch::nn::Linear>()->weight.mutable_grad() = torch::full({6, 6}, 7.0);
  std::vector<torch::Tensor> values;
  std::vector<const void*> storage;
  for (const auto& p : model->parameters()) {
    values.push_back(p.detach().clone());
    storage.push_back(p.data_ptr());
  }
  std::vector<torch::Tensor> buffers;
  for (const auto& b : model->buffers()) buffers.push_back(b.clone());

  gpipe::balance_by_time(2, model, torch::randn({8, 6}), gpipe::BalanceOptions().timeout(0.05));
  gpipe::balance_by_size(2, model, torch::randn({8, 6}));

  size_t i = 0;
  for (const auto& p : model->parameters()) {
    CHECK(p.equal(values[i]));
    CHECK(p.data_ptr() == storage[i]);
    ++i;
  }
  i = 0;
  for (const auto& b : model->buffers()) CHECK(b.equal(buffers[i++]));
  CHECK(model[0]->as<torch::nn::Linear>()->weight.grad().equal(torch::full({6, 6}, 7.0)));
  CHECK_FALSE(model[0]->as<torch::nn::Linear>()->bias.grad().defined());
  CHECK_FALSE(model[3]->as<torch::nn::Linear>()->weight.grad().defined());
  for (const auto& m : model->modules()) CHECK_FALSE(m->is_training());
}

TEST_CASE("balance: a Pipe without a balance computes one and trains", "[balance]") {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::Tanh(),
                              torch::nn::Linear(32, 32), torch::nn::Tanh(),
                              torch::nn::Linear(32, 1));
  const std::vector<torch::Device> cpus(3, torch::kCPU);
  gpipe::Pipe pipe(model, gpipe::PipeOptions().devices(cpus).chunks(4));
  REQUIRE(pipe->balance().size() == 3);
  CHECK(pipe->balance() == gpipe::balance_by_params(3, model));

  auto x = torch::randn({64, 8});
  auto y = x.sum(1, true).sin();
  torch::optim::Adam adam(pipe->parameters(), 1e-2);
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    auto loss = torch::mse_loss(pipe->forward(x), y);
    adam.zero_grad();
    loss.backward();
    adam.step();
    last = loss.item<double>();
    if (step == 0) first = last;
  }
  CHECK(last < 0.5 * first);

  // With a sample, by time; and without devices or balance on CPU, a clear refusal.
  torch::nn::Sequential slow(Sleep(1), Sleep(10), Sleep(1));
  gpipe::Pipe timed(slow, gpipe::PipeOptions()
                              .devices({torch::kCPU, torch::kCPU})
                              .sample(torch::ones({2, 2})));
  CHECK((timed->balance() == std::vector<int64_t>{2, 1} ||
         timed->balance() == std::vector<int64_t>{1, 2}));
  if (!torch::cuda::is_available()) {
    CHECK_THROWS_WITH(gpipe::Pipe(torch::nn::Sequential(torch::nn::Linear(2, 2)), gpipe::PipeOptions()),
                      Catch::Contains("balance is empty"));
  }
}
