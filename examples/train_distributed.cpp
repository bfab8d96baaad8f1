// train_distributed.cpp — trains an MLP pipelined over 2 processes (Gloo) from C++ alone, no Python, and checks every rank against the plain model.
//
//   build/example_train_distributed                    # starts its 2 ranks itself
//   torchrun --nproc-per-node 2 --no-python build/example_train_distributed
//
// With no RANK in the environment it is the launcher: it picks a free port
// and runs itself twice as ranks 0 and 1 (RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT, as torchrun sets them), waits for both and fails if either
// does. Each rank makes its process group with
// gpipe::distributed::init_process_group, then for each schedule (gpipe,
// 1f1b, zb_h1, zb_v) trains a float64 MLP as a gpipe::DistributedPipe for 3
// SGD steps beside the plain Sequential (every rank trains a plain copy on the
// whole batch), and checks the loss on the last stage's rank and the grads and
// weights of every parameter this rank holds (1e-10). Prints OK and exits 0,
// or says what differed and exits 1.
#include <gpipe/gpipe.h>

#include <torch/torch.h>

#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

constexpr int kRanks = 2;
constexpr double kTol = 1e-10;

torch::nn::Sequential make_mlp() {
  torch::manual_seed(0);  // the same weights on every rank and for the plain copy
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(),  //
                               torch::nn::Linear(16, 16), torch::nn::ReLU(),  //
                               torch::nn::Linear(16, 4));
}

torch::Tensor mse(const torch::Tensor& output, const torch::Tensor& target) {
  return torch::mse_loss(output, target);
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

/// Trains one schedule for 3 steps; returns the number of mismatches.
int check_schedule(const c10::intrusive_ptr<c10d::ProcessGroup>& group, gpipe::Schedule schedule,
                   std::vector<int64_t> balance) {
  torch::manual_seed(1);
  const auto x = torch::randn({12, 8});
  const auto y = torch::randn({12, 4});
  auto plain = make_mlp();
  gpipe::DistributedPipe pipe(make_mlp(), gpipe::DistributedPipeOptions(std::move(balance))
                                              .chunks(4).schedule(schedule).group(group));
  torch::optim::SGD plain_sgd(plain->parameters(), 0.1);
  torch::optim::SGD pipe_sgd(pipe->parameters(), 0.1);
  const auto reference = plain->named_parameters();
  int bad = 0;
  double worst = 0;
  for (int step = 0; step < 3; ++step) {
    plain_sgd.zero_grad();
    pipe_sgd.zero_grad();
    const auto expected = torch::mse_loss(plain->forward(x), y);
    expected.backward();
    const auto loss = pipe->train_step(pipe->is_first() ? x : torch::Tensor(),
                                       pipe->is_last() ? y : torch::Tensor(), mse);
    if (pipe->is_last()) {
      const double d = std::abs(loss.item<double>() - expected.item<double>());
      worst = std::max(worst, d);
      if (!(d <= kTol)) {
        std::printf("rank %ld %s step %d: loss %.17g, plain %.17g\n", pipe->rank(),
                    gpipe::to_string(schedule).c_str(), step, loss.item<double>(),
                    expected.item<double>());
        ++bad;
      }
    }
    for (const auto& p : pipe->named_parameters()) {
      const double d = max_diff(p.value().grad(), reference[p.key()].grad());
      worst = std::max(worst, d);
      if (!(d <= kTol)) {
        std::printf("rank %ld %s step %d: grad of %s differs by %g\n", pipe->rank(),
                    gpipe::to_string(schedule).c_str(), step, p.key().c_str(), d);
        ++bad;
      }
    }
    plain_sgd.step();
    pipe_sgd.step();
  }
  for (const auto& p : pipe->named_parameters()) {
    if (!(max_diff(p.value(), reference[p.key()]) <= kTol)) ++bad;
  }
  std::printf("rank %ld %-8s stages %s: %zu parameters, max |diff| %.3g over 3 steps\n",
              pipe->rank(), gpipe::to_string(schedule).c_str(),
              c10::str(pipe->stages()).c_str(), pipe->named_parameters().size(), worst);
  return bad;
}

int run_rank() {
  torch::set_default_dtype(caffe2::TypeMeta::Make<double>());
  auto group = gpipe::distributed::init_process_group(
      gpipe::distributed::ProcessGroupOptions().backend("gloo"));
  int bad = 0;
  bad += check_schedule(group, gpipe::Schedule::GPipe, {3, 2});
  bad += check_schedule(group, gpipe::Schedule::OneFOneB, {3, 2});
  bad += check_schedule(group, gpipe::Schedule::ZBH1, {3, 2});
  bad += check_schedule(group, gpipe::Schedule::ZBV, {2, 1, 1, 1});  // rank r: stages r, 3-r
  if (bad) {
    std::printf("rank %d: %d mismatches\n", group->getRank(), bad);
    return 1;
  }
  std::printf("rank %d: OK\n", group->getRank());
  return 0;
}

/// A TCP port nobody listens on now (the kernel's pick).
int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t size = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &size) != 0) {
    std::perror("example_train_distributed: no free port");
    std::exit(1);
  }
  close(fd);
  return ntohs(addr.sin_port);
}

/// Runs this program as ranks 0..kRanks-1 and waits for them (2 minutes at most).
int launch(const char* self) {
  const std::string port = std::to_string(free_port());
  std::vector<pid_t> pids;
  for (int rank = 0; rank < kRanks; ++rank) {
    std::vector<std::string> env = {"RANK=" + std::to_string(rank),
                                    "WORLD_SIZE=" + std::to_string(kRanks),
                                    "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port};
    for (char** e = environ; *e; ++e) env.emplace_back(*e);
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::string path = self;
    char* argv[] = {path.data(), nullptr};
    pid_t pid = 0;
    if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, envp.data()) != 0) {
      std::perror("example_train_distributed: posix_spawn");
      return 1;
    }
    pids.push_back(pid);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(2);
  int failed = 0;
  for (size_t left = pids.size(); left > 0;) {
    for (auto& pid : pids) {
      int status = 0;
      if (pid == 0 || waitpid(pid, &status, WNOHANG) == 0) continue;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
      pid = 0;
      --left;
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      std::printf("example_train_distributed: ranks still running after 2 minutes; killing them\n");
      for (pid_t pid : pids) {
        if (pid == 0) continue;
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
      }
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (failed) {
    std::printf("FAILED: %d of %d ranks\n", failed, kRanks);
    return 1;
  }
  std::printf("OK\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  (void)argc;
  if (std::getenv("RANK") == nullptr) return launch(argv[0]);
  try {
    return run_rank();
  } catch (const std::exception& e) {
    std::printf("rank %s: %s\n", std::getenv("RANK"), e.what());
    return 1;
  }
}
