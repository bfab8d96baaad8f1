// memory.cpp — peak memory and step time of checkpoint always / except_last / never, each in a fresh process.
//
//   bench_memory [--quick]                              all modes (as children), the table
//   bench_memory --measure memory --mode MODE [--quick]  child: one mode's peaks ("ROW ...")
//   bench_memory --measure time [--quick]               child: every mode's step times ("ROW ...")
//
// A 32-layer MLP (32 x (Linear(1024, 1024) + ReLU), batch 256), K = 4 stages
// of 8 pairs, M = 8 micro-batches, CPU, one intra-op thread per thread.
// Memory is measured for every mode in a fresh process (this binary re-run
// as a child), so no mode inherits another's heap:
//   * memory child: peak memory above the baseline, two ways. RSS: VmRSS just
//     before the measured step is the baseline, and the high-water mark
//     VmHWM is reset to it by writing "5" to /proc/self/clear_refs (where
//     the kernel refuses, RSS peaks are reported as nan and the headline
//     ratio uses the tensor peaks; the table says so). Before the baseline every parameter's grad
//     is allocated (zeros, accumulated in place), one warm-up step runs, and
//     malloc_trim(0) hands glibc's free memory back. Tensors: a counting
//     wrapper around the CPU allocator tracks live tensor bytes and their
//     peak, exactly. Two steps are measured: a training step, and a step
//     with frozen weights whose input needs grad: its peak is activations
//     and their grads only ("peak activation memory"), without the 4 MB
//     weight-grad buffer every Linear's backward allocates per micro-batch
//     (four stages at once: 16 MB, which dwarfs activations of 128 KB).
//   * time child: one Pipe per mode in one more fresh process with glibc's
//     default malloc (the memory child's fixed mmap threshold costs page
//     faults), training steps of the three interleaved, median step time.
//   * schedule child (--measure schedule --schedule gpipe|1f1b --mode MODE):
//     the same MLP at M = 16 trained with `train_step` (loss = output.sum()
//     on the last stage) in the order of `schedule`; tensor peaks (the
//     counting allocator) of a training step and of an activations step as
//     above. 1F1B holds at most K - j micro-batches on stage j against
//     GPipe's M at the turn: K/M = 0.25 on stage 0, K(K+1)/2 over K*M =
//     0.16 summed over the stages, plus what every schedule holds alike
//     (one micro-batch's backward buffers per stage, the input).
#include <gpipe/gpipe.h>

#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include "bench.h"

#include <malloc.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

// Live and peak bytes of every tensor the CPU allocator hands out.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t bytes) override {
    c10::DataPtr inner = base_->allocate(bytes);
    void* data = inner.get();
    const c10::Device device = inner.device();
    grow(static_cast<int64_t>(bytes));
    auto owner = std::make_unique<Owned>(Owned{std::move(inner), static_cast<int64_t>(bytes), tag_});
    return {data, owner.release(), &CountingAllocator::release, device};
  }
  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static int64_t live() { return live_.load(); }
  static int64_t peak() { return peak_.load(); }
  static void reset_peak() {
    peak_.store(live_.load());
    for (size_t s = 0; s < kStages; ++s) stage_peak_[s].store(stage_live_[s].load());
  }
  // Per stage: the bytes allocated by threads tagged with that stage (a
  // Tag layer opens each stage and tags its worker) and not yet freed.
  static constexpr size_t kStages = 16;
  static void tag_thread(int stage) { tag_ = stage; }
  static int64_t stage_live(size_t s) { return stage_live_[s].load(); }
  static int64_t stage_peak(size_t s) { return stage_peak_[s].load(); }

 private:
  struct Owned {
    c10::DataPtr inner;
    int64_t bytes;
    int stage;
  };
  static void release(void* context) {
    std::unique_ptr<Owned> owned(static_cast<Owned*>(context));
    live_.fetch_sub(owned->bytes);
    if (owned->stage >= 0) stage_live_[static_cast<size_t>(owned->stage)].fetch_sub(owned->bytes);
  }
  static void raise_peak(std::atomic<int64_t>& peak, int64_t now) {
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
  }
  static void grow(int64_t bytes) {
    raise_peak(peak_, live_.fetch_add(bytes) + bytes);
    if (tag_ >= 0) {
      const auto s = static_cast<size_t>(tag_);
      raise_peak(stage_peak_[s], stage_live_[s].fetch_add(bytes) + bytes);
    }
  }

  c10::Allocator* base_;
  static inline std::atomic<int64_t> live_{0};
  static inline std::atomic<int64_t> peak_{0};
  static inline std::array<std::atomic<int64_t>, kStages> stage_live_{};
  static inline std::array<std::atomic<int64_t>, kStages> stage_peak_{};
  static inline thread_local int tag_ = -1;
};

// Tags the thread running it with `stage` for the CountingAllocator: the
// first layer of each stage, whose worker runs that stage's forwards and
// backwards (one stage per worker).
class TagImpl : public torch::nn::Cloneable<TagImpl> {
 public:
  explicit TagImpl(int stage) : stage_(stage) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    CountingAllocator::tag_thread(stage_);
    return x;
  }

 private:
  int stage_;
};
TORCH_MODULE(Tag);

// A field of /proc/self/status in bytes ("VmRSS", "VmHWM"); -1 if absent.
int64_t status_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      std::istringstream rest(line.substr(field.size() + 1));
      int64_t kb = -1;
      rest >> kb;
      return kb * 1024;
    }
  }
  return -1;
}

// Resets VmHWM to the current RSS; false where the kernel does not allow it.
bool reset_high_water_mark() {
  std::ofstream clear("/proc/self/clear_refs");
  if (!clear) return false;
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

gpipe::Checkpoint parse_mode(const std::string& mode) {
  if (mode == "always") return gpipe::Checkpoint::Always;
  if (mode == "except_last") return gpipe::Checkpoint::ExceptLast;
  if (mode == "never") return gpipe::Checkpoint::Never;
  std::fprintf(stderr, "bench_memory: --mode is \"%s\"; use always, except_last or never\n",
               mode.c_str());
  std::exit(2);
}

struct Config {
  int64_t hidden, pairs, batch, k, m;
  int warmup, reps;
};

Config config(bool quick) {
  return quick ? Config{256, 8, 64, 4, 8, 1, 1} : Config{1024, 32, 256, 4, 8, 1, 9};
}

// The schedule comparison's: the same MLP cut into M = 16 micro-batches, so
// GPipe's M and 1F1B's K differ by 4x.
Config schedule_config(bool quick) {
  Config c = config(quick);
  c.m = 16;
  return c;
}

gpipe::Schedule parse_schedule(const std::string& schedule) {
  if (schedule == "gpipe") return gpipe::Schedule::GPipe;
  if (schedule == "1f1b") return gpipe::Schedule::OneFOneB;
  std::fprintf(stderr, "bench_memory: --schedule is \"%s\"; use gpipe or 1f1b\n",
               schedule.c_str());
  std::exit(2);
}

// The pipelined MLP of `mode`, with every parameter's grad allocated;
// `schedule` orders its train_step (forward ignores it).
gpipe::Pipe make_pipe(const Config& c, gpipe::Checkpoint checkpoint,
                      gpipe::Schedule schedule = gpipe::Schedule::OneFOneB) {
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int64_t i = 0; i < c.pairs; ++i) {
    model->push_back(torch::nn::Linear(c.hidden, c.hidden));
    model->push_back(torch::nn::ReLU());
  }
  gpipe::Pipe pipe(model,
                   gpipe::PipeOptions()
                       .balance(std::vector<int64_t>(static_cast<size_t>(c.k), 2 * c.pairs / c.k))
                       .devices(std::vector<c10::Device>(static_cast<size_t>(c.k), torch::kCPU))
                       .chunks(c.m)
                       .checkpoint(checkpoint)
                       .schedule(schedule));
  for (auto& p : pipe->parameters()) p.mutable_grad() = torch::zeros_like(p);
  return pipe;
}

// Peak RSS and peak live tensor bytes of one run of `step`, above what was
// live just before it.
struct Peak {
  double rss_mb, tensor_mb;
};

// The RSS peak is nan where the high-water mark cannot be reset (it would
// hold earlier peaks).
Peak measure_peak(const std::function<void()>& step, bool& reset_ok, double& baseline_mb) {
  malloc_trim(0);
  const int64_t baseline = status_bytes("VmRSS");
  reset_ok = reset_high_water_mark();
  CountingAllocator::reset_peak();
  const int64_t tensors = CountingAllocator::live();
  step();
  const int64_t hwm = status_bytes("VmHWM");
  baseline_mb = static_cast<double>(baseline) / (1 << 20);
  const double rss = reset_ok ? static_cast<double>(hwm - baseline) / (1 << 20)
                              : std::numeric_limits<double>::quiet_NaN();
  return {rss, static_cast<double>(CountingAllocator::peak() - tensors) / (1 << 20)};
}

// --measure memory: peaks of a training step, and of a step whose weights
// need no grad (activations and their grads only). glibc gets a fixed
// mmap threshold of 64 KiB first, so every tensor of 64 KiB or more is its
// own mapping, returned to the kernel when freed, and RSS follows live
// memory; with glibc's default (a threshold that rises to 32 MiB and heaps
// that keep freed memory) the high-water mark measures heap fragmentation
// as much as the step (74-109 MB for 24 MB of tensors, run to run).
int measure_memory(const std::string& mode, bool quick) {
  mallopt(M_MMAP_THRESHOLD, 64 * 1024);
  static CountingAllocator counting(c10::GetCPUAllocator());
  c10::SetCPUAllocator(&counting, /*priority=*/1);
  at::set_num_threads(1);
  const Config c = config(quick);
  auto pipe = make_pipe(c, parse_mode(mode));
  const auto x = torch::randn({c.batch, c.hidden});
  auto train = [&] { pipe->forward(x).sum().backward(); };

  train();  // warm-up: allocator caches, oneDNN/MKL buffers, first-touch pages
  bool reset = false;
  double baseline_mb = 0;
  const Peak training = measure_peak(train, reset, baseline_mb);

  // Activations only: frozen weights, an input that needs grad (so every
  // stage still keeps or recomputes its graph).
  for (auto& p : pipe->parameters()) p.requires_grad_(false);
  const auto xg = x.clone().requires_grad_(true);
  auto activations_step = [&] { pipe->forward(xg).sum().backward(); };
  activations_step();
  bool reset2 = false;
  double baseline2_mb = 0;
  const Peak activations = measure_peak(activations_step, reset2, baseline2_mb);

  std::printf(
      "ROW mode=%s train_rss_mb=%.1f train_tensor_mb=%.1f act_rss_mb=%.1f "
      "act_tensor_mb=%.1f baseline_mb=%.1f hwm_reset=%d\n",
      mode.c_str(), training.rss_mb, training.tensor_mb, activations.rss_mb, activations.tensor_mb,
      baseline_mb, reset && reset2 ? 1 : 0);
  return 0;
}

// --measure schedule: tensor peaks of train_step in the order of
// `schedule`, a training step and an activations step (frozen weights, an
// input that needs grad). Tensor peaks only: the comparison is between
// schedules in the same configuration, and the counting allocator is exact.
int measure_schedule(const std::string& schedule, const std::string& mode, bool quick) {
  static CountingAllocator counting(c10::GetCPUAllocator());
  c10::SetCPUAllocator(&counting, /*priority=*/1);
  at::set_num_threads(1);
  const Config c = schedule_config(quick);
  auto pipe = make_pipe(c, parse_mode(mode), parse_schedule(schedule));
  const auto x = torch::randn({c.batch, c.hidden});
  const auto target = torch::zeros({c.batch, 1});
  const gpipe::PipeImpl::LossFn loss = [](const torch::Tensor& out, const torch::Tensor&) {
    return out.sum();
  };
  auto train = [&] { pipe->train_step(x, target, loss); };
  train();  // warm-up
  bool reset = false;
  double baseline_mb = 0;
  const Peak training = measure_peak(train, reset, baseline_mb);

  for (auto& p : pipe->parameters()) p.requires_grad_(false);
  const auto xg = x.clone().requires_grad_(true);
  auto activations_step = [&] { pipe->train_step(xg, target, loss); };
  activations_step();
  const Peak activations = measure_peak(activations_step, reset, baseline_mb);
  std::printf("ROW schedule=%s mode=%s train_tensor_mb=%.3f act_tensor_mb=%.3f\n",
              schedule.c_str(), mode.c_str(), training.tensor_mb, activations.tensor_mb);
  return 0;
}

// --measure stages --policy M0,M1,...: per-stage tensor peaks of an
// activations step (frozen weights, an input that needs grad) of 1F1B's
// train_step at M = 16, with checkpoint mode M_j on stage j. Prints
// "ROW policy=... s0=MB s1=MB ... total=MB".
int measure_stages(const std::string& policy, bool quick) {
  static CountingAllocator counting(c10::GetCPUAllocator());
  c10::SetCPUAllocator(&counting, /*priority=*/1);
  at::set_num_threads(1);
  const Config c = schedule_config(quick);
  std::vector<gpipe::Checkpoint> modes;
  {
    std::istringstream in(policy);
    for (std::string m; std::getline(in, m, ',');) modes.push_back(parse_mode(m));
  }
  if (static_cast<int64_t>(modes.size()) != c.k) {
    std::fprintf(stderr, "bench_memory: --policy has %zu modes for %lld stages\n", modes.size(),
                 static_cast<long long>(c.k));
    return 2;
  }
  torch::manual_seed(0);
  torch::nn::Sequential model;
  const int64_t per = c.pairs / c.k;
  for (int64_t j = 0; j < c.k; ++j) {
    model->push_back(Tag(static_cast<int>(j)));
    for (int64_t i = 0; i < per; ++i) {
      model->push_back(torch::nn::Linear(c.hidden, c.hidden));
      model->push_back(torch::nn::ReLU());
    }
  }
  for (auto& p : model->parameters()) p.requires_grad_(false);
  gpipe::Pipe pipe(model,
                   gpipe::PipeOptions()
                       .balance(std::vector<int64_t>(static_cast<size_t>(c.k), 2 * per + 1))
                       .devices(std::vector<c10::Device>(static_cast<size_t>(c.k), torch::kCPU))
                       .chunks(c.m)
                       .stage_checkpoints(modes)
                       .schedule(gpipe::Schedule::OneFOneB));
  const auto x = torch::randn({c.batch, c.hidden}).requires_grad_(true);
  const auto target = torch::zeros({c.batch, 1});
  const gpipe::PipeImpl::LossFn loss = [](const torch::Tensor& out, const torch::Tensor&) {
    return out.sum();
  };
  auto step = [&] { pipe->train_step(x, target, loss); };
  step();  // warm-up
  std::vector<int64_t> before;
  for (int64_t j = 0; j < c.k; ++j) before.push_back(CountingAllocator::stage_live(j));
  CountingAllocator::reset_peak();
  const int64_t tensors = CountingAllocator::live();
  step();
  std::string row = "ROW policy=" + policy;
  for (int64_t j = 0; j < c.k; ++j) {
    const double mb = static_cast<double>(CountingAllocator::stage_peak(j) - before[j]) / (1 << 20);
    row += " s" + std::to_string(j) + "=" + bench::fixed(mb, 3);
  }
  row += " total=" +
         bench::fixed(static_cast<double>(CountingAllocator::peak() - tensors) / (1 << 20), 3);
  std::printf("%s\n", row.c_str());
  return 0;
}

// --measure time: training steps of all three modes, one Pipe each, in one
// fresh process with glibc's default malloc, interleaved step by step so a
// slow spell of this shared machine lands on every mode alike. Prints
// "ROW always=ms,ms,... except_last=... never=...".
int measure_time(const std::vector<std::string>& modes, bool quick) {
  at::set_num_threads(1);
  const Config c = config(quick);
  const auto x = torch::randn({c.batch, c.hidden});
  std::vector<gpipe::Pipe> pipes;
  for (const auto& m : modes) pipes.push_back(make_pipe(c, parse_mode(m)));
  std::vector<std::vector<double>> times(modes.size());
  for (int r = 0; r < c.warmup + c.reps; ++r) {
    for (size_t i = 0; i < modes.size(); ++i) {
      const double t =
          bench::time_runs([&] { pipes[i]->forward(x).sum().backward(); }, 0, 1).front();
      if (r >= c.warmup) times[i].push_back(t);
    }
  }
  std::string row = "ROW";
  for (size_t i = 0; i < modes.size(); ++i) {
    row += " " + modes[i] + "=";
    for (size_t k = 0; k < times[i].size(); ++k) {
      if (k > 0) row += ',';
      row += bench::fixed(times[i][k] * 1e3, 1);
    }
  }
  std::printf("%s\n", row.c_str());
  return 0;
}

// Runs this binary again with `args` and returns its ROW fields.
std::map<std::string, std::string> run_child(const std::string& args) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) {
    std::fprintf(stderr, "bench_memory: cannot read /proc/self/exe to start a child process\n");
    std::exit(1);
  }
  self[n] = '\0';
  const std::string command = std::string("'") + self + "' " + args;
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(command.c_str(), "r"), pclose);
  std::map<std::string, std::string> fields;
  if (!pipe) return fields;
  char buf[1024];
  while (std::fgets(buf, sizeof buf, pipe.get())) {
    std::string line(buf);
    if (line.rfind("ROW ", 0) != 0) {
      std::fputs(buf, stdout);
      continue;
    }
    std::istringstream words(line.substr(4));
    std::string word;
    while (words >> word) {
      const auto eq = word.find('=');
      if (eq != std::string::npos) fields[word.substr(0, eq)] = word.substr(eq + 1);
    }
  }
  if (fields.empty()) {
    std::fprintf(stderr, "bench_memory: the child `%s` printed no ROW line\n", command.c_str());
    std::exit(1);
  }
  return fields;
}

std::vector<double> numbers(const std::string& list) {
  std::vector<double> out;
  std::istringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stod(item));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = bench::quick(argc, argv);
  const std::vector<std::string> modes = {"always", "except_last", "never"};
  std::string mode, measure, schedule, policy;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--mode") mode = argv[i + 1];
    if (std::string(argv[i]) == "--measure") measure = argv[i + 1];
    if (std::string(argv[i]) == "--schedule") schedule = argv[i + 1];
    if (std::string(argv[i]) == "--policy") policy = argv[i + 1];
  }
  if (measure == "stages" && !policy.empty()) return measure_stages(policy, quick);
  if (measure == "memory" && !mode.empty()) return measure_memory(mode, quick);
  if (measure == "schedule" && !mode.empty() && !schedule.empty()) {
    return measure_schedule(schedule, mode, quick);
  }
  if (measure == "time") return measure_time(modes, quick);
  if (!measure.empty() || !mode.empty()) {
    std::fprintf(stderr,
                 "bench_memory: got --measure \"%s\" --mode \"%s\"; use --measure memory "
                 "--mode always|except_last|never, --measure schedule --schedule gpipe|1f1b "
                 "--mode always|except_last|never, --measure time, or no arguments\n",
                 measure.c_str(), mode.c_str());
    return 2;
  }

  const std::string q = quick ? " --quick" : "";
  std::map<std::string, std::map<std::string, std::string>> mem;
  for (const auto& m : modes) mem[m] = run_child("--measure memory --mode " + m + q);
  auto timing = run_child("--measure time" + q);
  std::map<std::string, std::vector<double>> times;
  for (const auto& m : modes) times[m] = numbers(timing[m]);
  auto num = [&](const std::string& m, const std::string& key) { return std::stod(mem[m][key]); };
  auto step = [&](const std::string& m) { return bench::median(times[m]); };
  auto ratio = [&](const std::string& m, const std::string& key) {
    return num(m, key) / num("never", key);
  };

  // Ratios of RSS peaks, unless some child could not reset VmHWM: then of
  // tensor peaks.
  bool rss_ok = true;
  for (const auto& m : modes) rss_ok = rss_ok && mem[m]["hwm_reset"] == "1";
  const std::string act = rss_ok ? "act_rss_mb" : "act_tensor_mb";
  const std::string train = rss_ok ? "train_rss_mb" : "train_tensor_mb";

  const Config c = config(quick);
  std::printf(
      "memory: MLP of %lld x (Linear(%lld, %lld) + ReLU), batch %lld, K=%lld, M=%lld, CPU, "
      "1 intra-op thread; each mode's memory in its own fresh process\n",
      static_cast<long long>(c.pairs), static_cast<long long>(c.hidden),
      static_cast<long long>(c.hidden), static_cast<long long>(c.batch),
      static_cast<long long>(c.k), static_cast<long long>(c.m));
  std::printf(
      "memory: peaks above the RSS just before the step (%s MB: parameters, their grads, "
      "the input; after a warm-up step and malloc_trim), VmHWM reset through "
      "/proc/self/clear_refs: %s; glibc mmap threshold fixed at 64 KiB\n",
      mem["never"]["baseline_mb"].c_str(),
      rss_ok ? "yes" : "NO: RSS peaks are nan, ratios use the tensor peaks");
  std::printf(
      "memory: \"activations\" = a step with frozen weights (input requires grad): no "
      "weight-grad buffers (4 MB per Linear, per micro-batch) in the peak\n");
  std::printf(
      "memory: step time = median of %zu training steps per mode, the modes interleaved step "
      "by step in one more fresh process (default malloc)\n\n",
      times["never"].size());
  bench::Table table({"checkpoint", "act RSS MB", "act tensors MB", "train RSS MB",
                      "train tensors MB", "step ms", "act / never", "train / never",
                      "time / never"});
  for (const auto& m : modes) {
    table.add({m, bench::fixed(num(m, "act_rss_mb"), 1), bench::fixed(num(m, "act_tensor_mb"), 1),
               bench::fixed(num(m, "train_rss_mb"), 1), bench::fixed(num(m, "train_tensor_mb"), 1),
               bench::fixed(step(m), 1), bench::fixed(ratio(m, act), 3),
               bench::fixed(ratio(m, train), 3),
               bench::fixed(step(m) / step("never"), 3)});
  }
  table.print();
  std::printf(
      "\nBENCH memory always_over_never=%.3f time_always_over_never=%.3f "
      "train_always_over_never=%.3f except_last_over_never=%.3f "
      "time_except_last_over_never=%.3f\n",
      ratio("always", act), step("always") / step("never"), ratio("always", train),
      ratio("except_last", act),
      step("except_last") / step("never"));

  // ---- schedules: train_step's peaks, 1f1b against gpipe --------------------------------
  const std::vector<std::string> schedule_modes = {"never", "except_last", "always"};
  std::map<std::string, std::map<std::string, std::map<std::string, std::string>>> sched;
  for (const auto& m : schedule_modes) {
    for (const std::string s : {"gpipe", "1f1b"}) {
      sched[m][s] = run_child("--measure schedule --schedule " + s + " --mode " + m + q);
    }
  }
  auto sched_num = [&](const std::string& m, const std::string& s, const std::string& key) {
    return std::stod(sched[m][s][key]);
  };
  auto over_gpipe = [&](const std::string& m, const std::string& key) {
    return sched_num(m, "1f1b", key) / sched_num(m, "gpipe", key);
  };
  const Config sc = schedule_config(quick);
  std::printf(
      "\nmemory: schedules: the same MLP, K=%lld, M=%lld, train_step (loss = output.sum()), "
      "tensor peaks above what was live before the step, each schedule and checkpoint mode in "
      "its own fresh process; theory for activations (1f1b / gpipe): K/M = %.3f on stage 0, "
      "K(K+1)/2 / (K*M) = %.3f over all stages\n\n",
      static_cast<long long>(sc.k), static_cast<long long>(sc.m),
      static_cast<double>(sc.k) / static_cast<double>(sc.m),
      static_cast<double>(sc.k + 1) / (2.0 * static_cast<double>(sc.m)));
  bench::Table sched_table({"checkpoint", "gpipe act MB", "1f1b act MB", "act 1f1b/gpipe",
                            "gpipe train MB", "1f1b train MB", "train 1f1b/gpipe"});
  for (const auto& m : schedule_modes) {
    sched_table.add({m, bench::fixed(sched_num(m, "gpipe", "act_tensor_mb"), 2),
                     bench::fixed(sched_num(m, "1f1b", "act_tensor_mb"), 2),
                     bench::fixed(over_gpipe(m, "act_tensor_mb"), 3),
                     bench::fixed(sched_num(m, "gpipe", "train_tensor_mb"), 2),
                     bench::fixed(sched_num(m, "1f1b", "train_tensor_mb"), 2),
                     bench::fixed(over_gpipe(m, "train_tensor_mb"), 3)});
  }
  sched_table.print();
  std::printf(
      "\nBENCH memory schedule=1f1b activations_over_gpipe=%.3f train_over_gpipe=%.3f "
      "except_last_activations_over_gpipe=%.3f always_activations_over_gpipe=%.3f\n",
      over_gpipe("never", "act_tensor_mb"), over_gpipe("never", "train_tensor_mb"),
      over_gpipe("except_last", "act_tensor_mb"), over_gpipe("always", "act_tensor_mb"));

  // ---- a checkpoint mode per stage: per-stage peaks under 1F1B ------------------------------
  const std::vector<std::string> policies = {"never,never,never,never",
                                             "always,always,always,always",
                                             "always,except_last,never,never"};
  std::map<std::string, std::map<std::string, std::string>> per;
  for (const auto& p : policies) per[p] = run_child("--measure stages --policy " + p + q);
  std::printf(
      "\nmemory: a checkpoint mode per stage: the same MLP (frozen weights, input needs grad), "
      "1f1b train_step, K=%lld, M=%lld; tensor peak of what each stage's worker allocated and "
      "had not freed (stage j holds up to K - j micro-batches), MB\n\n",
      static_cast<long long>(sc.k), static_cast<long long>(sc.m));
  std::vector<std::string> header{"policy"};
  for (int64_t j = 0; j < sc.k; ++j) header.push_back("stage " + std::to_string(j));
  header.push_back("whole step");
  bench::Table per_table(header);
  for (const auto& p : policies) {
    std::vector<std::string> row{p};
    for (int64_t j = 0; j < sc.k; ++j) row.push_back(per[p]["s" + std::to_string(j)]);
    row.push_back(per[p]["total"]);
    per_table.add(row);
  }
  per_table.print();
  const auto& mixed = per[policies[2]];
  const auto& never = per[policies[0]];
  std::printf(
      "\nBENCH memory per_stage policy=always,except_last,never,never stage0_over_never=%.3f "
      "last_over_never=%.3f total_over_never=%.3f\n",
      std::stod(mixed.at("s0")) / std::stod(never.at("s0")),
      std::stod(mixed.at("s" + std::to_string(sc.k - 1))) /
          std::stod(never.at("s" + std::to_string(sc.k - 1))),
      std::stod(mixed.at("total")) / std::stod(never.at("total")));
  return 0;
}
