// test_distributed_fuzz.cpp — seeded random pipelines: DistributedPipe (threads on fake groups) equals gpipe::Pipe and the plain Sequential, step after step.
//
// Each seed draws one configuration: ranks, hand-off matching (by tag, or
// by order with a reverse group), schedule, checkpoint mode, chunks, a
// random model from the zoo below cut by a random balance, and 1-3 steps
// whose batch rows, sequence length or number of dims may change between steps (and
// change back, the ordered transport's predicted-shape path). A quarter of
// the models tie two layers' weights, on one stage, two, or two ranks. After every
// step, every rank's grads (accumulated, never zeroed) and the last rank's
// loss equal Pipe's train_step and the plain Sequential's backward; the
// last rank's eval equals the plain forward. About 3 seeds in 10 run a
// random schedule table (schedule_csv: the stages in a loop or, two per rank,
// in a V; each backward whole or split into I and W; the rows' orders from
// one random serial run of the tasks) in place of the schedule, and about a
// quarter give each stage its own checkpoint mode (stage_checkpoints); both
// drawn by a generator of their own, so the other draws of a seed stay as
// they were. A failure prints the seed and
// the configuration; rerun just it with GPIPE_DIST_FUZZ_SEEDS=seed:seed+1.
//
// GPIPE_DIST_FUZZ_SEEDS=a:b runs seeds a, a+1, ..., b-1 instead of the
// default range (for long manual runs); GPIPE_DIST_FUZZ_VERBOSE=1 prints
// each configuration before it runs.
#include <gpipe/distributed_pipe.h>

#include "fake_group.h"
#include "models.h"

#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <tuple>

using namespace gpipe_test;
using gpipe::Checkpoint;
using gpipe::Schedule;

namespace {

using namespace std::chrono_literals;
using Tensors = std::vector<torch::Tensor>;

constexpr int64_t kWidth = 4;          // every tensor's last dim
constexpr uint64_t kDefaultSeeds = 100; // seeds 0 .. kDefaultSeeds-1 by default

torch::nn::Linear linear64() {
  torch::nn::Linear l(kWidth, kWidth);
  l->to(torch::kFloat64);
  return l;
}

// ---- the zoo ------------------------------------------------------------------
// Layers on one tensor, layers on tuples (a vector of 1-8 tensors of one
// shape), and the two between them; Stash/Pop (one tensor) and TStash/TPop
// (tuples) carry skips.

/// tanh(Linear(x)); stashes x under `name`.
class StashImpl : public torch::nn::Cloneable<StashImpl>, public gpipe::Skippable {
 public:
  explicit StashImpl(std::string name) : gpipe::Skippable({.stash = {name}}), name_(std::move(name)) {
    reset();
  }
  void reset() override { linear = register_module("linear", linear64()); }
  torch::Tensor forward(const torch::Tensor& x) {
    stash(name_, x);
    return torch::tanh(linear(x));
  }
  torch::nn::Linear linear{nullptr};

 private:
  std::string name_;
};
TORCH_MODULE(Stash);

/// tanh(Linear(x)) + half of what `name` carried.
class PopImpl : public torch::nn::Cloneable<PopImpl>, public gpipe::Skippable {
 public:
  explicit PopImpl(std::string name) : gpipe::Skippable({.pop = {name}}), name_(std::move(name)) {
    reset();
  }
  void reset() override { linear = register_module("linear", linear64()); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(linear(x)) + 0.5 * pop(name_); }
  torch::nn::Linear linear{nullptr};

 private:
  std::string name_;
};
TORCH_MODULE(Pop);

/// x -> (tanh(L x), x): one tensor in, two out.
class ForkImpl : public torch::nn::Cloneable<ForkImpl> {
 public:
  ForkImpl() { reset(); }
  void reset() override { linear = register_module("linear", linear64()); }
  Tensors forward(const torch::Tensor& x) { return {torch::tanh(linear(x)), x}; }
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(Fork);

/// (a, b, ...) -> L a + half the rest: a tuple in, one tensor out.
class JoinImpl : public torch::nn::Cloneable<JoinImpl> {
 public:
  JoinImpl() { reset(); }
  void reset() override { linear = register_module("linear", linear64()); }
  torch::Tensor forward(Tensors in) {
    auto y = linear(in[0]);
    for (size_t k = 1; k < in.size(); ++k) y = y + 0.5 * in[k];
    return y;
  }
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(Join);

/// K -> K: out_i = tanh(L_i in_i + in_{i+1 mod K}); every output depends on
/// two inputs, so a swapped or dropped hand-off shows.
class MixImpl : public torch::nn::Cloneable<MixImpl> {
 public:
  explicit MixImpl(int64_t arity) : arity_(arity) { reset(); }
  void reset() override {
    linears.clear();
    for (int64_t k = 0; k < arity_; ++k) {
      linears.push_back(register_module("l" + std::to_string(k), linear64()));
    }
  }
  Tensors forward(Tensors in) {
    Tensors out;
    const auto n = in.size();
    for (size_t k = 0; k < n; ++k) out.push_back(torch::tanh(linears[k](in[k]) + in[(k + 1) % n]));
    return out;
  }
  std::vector<torch::nn::Linear> linears;

 private:
  int64_t arity_;
};
TORCH_MODULE(Mix);

/// K -> K: tanh of each (no parameters).
class TTanhImpl : public torch::nn::Cloneable<TTanhImpl> {
 public:
  void reset() override {}
  Tensors forward(Tensors in) {
    for (auto& t : in) t = torch::tanh(t);
    return in;
  }
};
TORCH_MODULE(TTanh);

/// K -> K+1: appends tanh(L in_last) * in_0.
class SplitImpl : public torch::nn::Cloneable<SplitImpl> {
 public:
  SplitImpl() { reset(); }
  void reset() override { linear = register_module("linear", linear64()); }
  Tensors forward(Tensors in) {
    in.push_back(torch::tanh(linear(in.back())) * in.front());
    return in;
  }
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(Split);

/// K -> 2K: appends tanh(L in_k) * in_{k+1 mod K} for each k (wide tuples:
/// long hand-off headers).
class WidenImpl : public torch::nn::Cloneable<WidenImpl> {
 public:
  WidenImpl() { reset(); }
  void reset() override { linear = register_module("linear", linear64()); }
  Tensors forward(Tensors in) {
    const auto n = in.size();
    for (size_t k = 0; k < n; ++k) in.push_back(torch::tanh(linear(in[k])) * in[(k + 1) % n]);
    return in;
  }
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(Widen);

/// K -> K-1: the last two become L in_{K-2} + tanh(in_{K-1}).
class MergeImpl : public torch::nn::Cloneable<MergeImpl> {
 public:
  MergeImpl() { reset(); }
  void reset() override { linear = register_module("linear", linear64()); }
  Tensors forward(Tensors in) {
    auto last = in.back();
    in.pop_back();
    in.back() = linear(in.back()) + torch::tanh(last);
    return in;
  }
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(Merge);

/// K -> K: stashes in_{which mod K} under `name`; out_0 = tanh(L in_0).
class TStashImpl : public torch::nn::Cloneable<TStashImpl>, public gpipe::Skippable {
 public:
  TStashImpl(std::string name, int64_t which)
      : gpipe::Skippable({.stash = {name}}), name_(std::move(name)), which_(which) {
    reset();
  }
  void reset() override { linear = register_module("linear", linear64()); }
  Tensors forward(Tensors in) {
    stash(name_, in[static_cast<size_t>(which_) % in.size()]);
    in[0] = torch::tanh(linear(in[0]));
    return in;
  }
  torch::nn::Linear linear{nullptr};

 private:
  std::string name_;
  int64_t which_;
};
TORCH_MODULE(TStash);

/// K -> K: out_last = tanh(L in_last) + half of what `name` carried.
class TPopImpl : public torch::nn::Cloneable<TPopImpl>, public gpipe::Skippable {
 public:
  explicit TPopImpl(std::string name) : gpipe::Skippable({.pop = {name}}), name_(std::move(name)) {
    reset();
  }
  void reset() override { linear = register_module("linear", linear64()); }
  Tensors forward(Tensors in) {
    in.back() = torch::tanh(linear(in.back())) + 0.5 * pop(name_);
    return in;
  }
  torch::nn::Linear linear{nullptr};

 private:
  std::string name_;
};
TORCH_MODULE(TPop);

// ---- a configuration ----------------------------------------------------------

enum class Kind {
  Linear, Tanh, Stash, Pop, Fork, Join, Mix, TTanh, Split, Widen, Merge, TStash, TPop, Tied
};

const char* name_of(Kind k) {
  switch (k) {
    case Kind::Linear: return "Linear";
    case Kind::Tanh: return "Tanh";
    case Kind::Stash: return "Stash";
    case Kind::Pop: return "Pop";
    case Kind::Fork: return "Fork";
    case Kind::Join: return "Join";
    case Kind::Mix: return "Mix";
    case Kind::TTanh: return "TTanh";
    case Kind::Split: return "Split";
    case Kind::Widen: return "Widen";
    case Kind::Merge: return "Merge";
    case Kind::TStash: return "TStash";
    case Kind::TPop: return "TPop";
    case Kind::Tied: return "Tied";
  }
  return "?";
}

struct LayerSpec {
  Kind kind;
  int64_t arity = 0;  // tensors it takes: 0 = one plain tensor, K = a tuple of K
  std::string skip;   // the skip's name (Stash, Pop, TStash, TPop)
  int64_t which = 0;  // TStash: the tuple element it stashes
};

struct StepShape {
  int64_t rows;
  int64_t seq;  // 0: 2-D tensors (rows, kWidth); else (rows, seq, kWidth)
};

struct Config {
  uint64_t seed;
  int ranks;
  FakeMatching matching;
  Schedule schedule;
  int64_t virtual_stages;
  Checkpoint checkpoint;
  int64_t chunks;
  int64_t in_arity;   // 0: train_step with one tensor; K: train_step_tuple with K inputs
  int64_t out_arity;  // the same for outputs and targets
  int64_t widest = 0;  // the most values any layer returns
  std::vector<LayerSpec> layers;
  std::vector<int64_t> balance;
  std::vector<StepShape> steps;
  std::string table;  // schedule_csv; empty: `schedule`
  bool v_shaped = false;  // the stages lie in a V (zb_v, or a table so placed)
  std::vector<Checkpoint> stage_modes;  // empty: `checkpoint`
};

std::string describe(const Config& c) {
  std::ostringstream s;
  s << "seed " << c.seed << " (rerun: GPIPE_DIST_FUZZ_SEEDS=" << c.seed << ":" << c.seed + 1
    << "): " << c.ranks << " ranks, "
    << (c.matching == FakeMatching::ByTag ? "by tag (gloo)" : "by order (fake_nccl + reverse group)")
    << ", " << c.schedule << ", virtual_stages " << c.virtual_stages << ", checkpoint "
    << c.checkpoint << ", chunks " << c.chunks << ", inputs "
    << (c.in_arity == 0 ? std::string("one tensor") : "tuple of " + std::to_string(c.in_arity))
    << ", outputs "
    << (c.out_arity == 0 ? std::string("one tensor") : "tuple of " + std::to_string(c.out_arity))
    << ", widest tuple " << c.widest << "\n  balance {";
  for (size_t j = 0; j < c.balance.size(); ++j) s << (j ? ", " : "") << c.balance[j];
  s << "}";
  if (!c.stage_modes.empty()) {
    s << "\n  stage checkpoints {";
    for (size_t j = 0; j < c.stage_modes.size(); ++j) s << (j ? ", " : "") << c.stage_modes[j];
    s << "}";
  }
  if (!c.table.empty()) {
    s << "\n  table (" << (c.v_shaped ? "V" : "loop") << "):\n    ";
    for (const char ch : c.table) {
      if (ch == '\n') s << "\n    ";
      else s << ch;
    }
  }
  s << "\n  layers:";
  for (size_t i = 0; i < c.layers.size(); ++i) {
    const auto& l = c.layers[i];
    s << " " << i << ":" << name_of(l.kind);
    if (l.kind == Kind::Mix) s << "(" << l.arity << ")";
    if (!l.skip.empty()) {
      s << "[" << l.skip << (l.kind == Kind::TStash ? "#" + std::to_string(l.which) : "") << "]";
    }
  }
  s << "\n  steps (rows x seq x width):";
  for (const auto& st : c.steps) {
    s << " " << st.rows << "x" << (st.seq ? std::to_string(st.seq) + "x" : "") << kWidth;
  }
  return s.str();
}

/// Deterministic draws (no std:: distributions: their results differ
/// between standard libraries).
struct Draw {
  std::mt19937_64 engine;
  explicit Draw(uint64_t seed) : engine(seed * 0x9E3779B97F4A7C15ULL + 12345) {}
  int64_t in(int64_t lo, int64_t hi) {  // lo..hi inclusive
    return lo + static_cast<int64_t>(engine() % static_cast<uint64_t>(hi - lo + 1));
  }
  bool chance(int64_t percent) { return in(0, 99) < percent; }
  template <typename T>
  T pick(const std::vector<T>& v) {
    return v[static_cast<size_t>(in(0, static_cast<int64_t>(v.size()) - 1))];
  }
};

// A valid schedule table for `stages` stages on `rows` rows (stage s on row
// s mod rows, or in a V: row r holds stages r and 2 rows - 1 - r) and `m`
// micro-batches: each backward whole (B) or split (I, then W) at random,
// the rows' orders from one random serial run of the tasks, each picked
// among those whose inputs are done (so none deadlocks; stages may run
// their micro-batches out of order, W's long after their I's).
std::string random_table(Draw& d, int64_t stages, int64_t rows, int64_t m, bool v_shaped) {
  struct Task {
    char op;
    int64_t stage, mb;
  };
  std::vector<std::vector<bool>> split(static_cast<size_t>(stages));
  std::vector<Task> pending;
  for (int64_t st = 0; st < stages; ++st) {
    for (int64_t i = 0; i < m; ++i) {
      split[static_cast<size_t>(st)].push_back(d.chance(50));
      for (const char op : split[static_cast<size_t>(st)].back() ? std::string("FIW")
                                                                   : std::string("FB")) {
        pending.push_back({op, st, i});
      }
    }
  }
  std::set<std::tuple<char, int64_t, int64_t>> done;
  auto ready = [&](const Task& t) {
    if (t.op == 'F') return t.stage == 0 || done.count({'F', t.stage - 1, t.mb}) > 0;
    if (t.op == 'W') return done.count({'I', t.stage, t.mb}) > 0;
    if (done.count({'F', t.stage, t.mb}) == 0) return false;
    if (t.stage + 1 == stages) return true;
    const char after = split[static_cast<size_t>(t.stage + 1)][static_cast<size_t>(t.mb)] ? 'I' : 'B';
    return done.count({after, t.stage + 1, t.mb}) > 0;
  };
  std::vector<std::vector<std::string>> table(static_cast<size_t>(rows));
  while (!pending.empty()) {
    std::vector<size_t> candidates;
    for (size_t k = 0; k < pending.size(); ++k) {
      if (ready(pending[k])) candidates.push_back(k);
    }
    const size_t k = d.pick(candidates);
    const Task t = pending[k];
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(k));
    done.insert({t.op, t.stage, t.mb});
    const int64_t row = v_shaped && t.stage >= rows ? 2 * rows - 1 - t.stage : t.stage % rows;
    table[static_cast<size_t>(row)].push_back(std::to_string(t.stage) + t.op +
                                              std::to_string(t.mb));
  }
  std::string csv;
  for (const auto& row : table) {
    for (size_t k = 0; k < row.size(); ++k) csv += (k ? "," : "") + row[k];
    csv += "\n";
  }
  return csv;
}

Config draw_config(uint64_t seed) {
  Draw d(seed);
  Config c;
  c.seed = seed;
  c.ranks = static_cast<int>(d.in(2, 4));
  c.matching = d.chance(50) ? FakeMatching::ByTag : FakeMatching::ByOrder;
  c.schedule = d.pick(std::vector<Schedule>{Schedule::GPipe, Schedule::OneFOneB,
                                            Schedule::Interleaved1F1B, Schedule::ZBH1});
  // Half the zb_h1 draws run ZB-V instead: two stages per rank in a V.
  if (c.schedule == Schedule::ZBH1 && d.chance(50)) c.schedule = Schedule::ZBV;
  c.virtual_stages = c.schedule == Schedule::Interleaved1F1B ? d.in(2, 3)
                     : c.schedule == Schedule::ZBV          ? 2
                                                            : 1;
  c.checkpoint = d.pick(std::vector<Checkpoint>{Checkpoint::Always, Checkpoint::ExceptLast,
                                                Checkpoint::Never});
  c.chunks = d.in(1, 6);

  const int64_t stages = c.ranks * c.virtual_stages;
  const int64_t most = stages >= 8 ? 2 : 3;
  int64_t total = 0;
  for (int64_t j = 0; j < stages; ++j) {
    c.balance.push_back(d.in(1, most));
    total += c.balance.back();
  }

  // Tensor in/out (train_step), possibly with a tuple section inside, or
  // tuples in/out (train_step_tuple).
  const bool tuple_io = d.chance(50);
  // Some models carry wide tuples (up to 8 values: with 3-D values, a
  // hand-off header longer than the first message's 62 integers).
  const int64_t widest = d.chance(30) ? 8 : 3;
  c.in_arity = tuple_io ? d.in(1, 3) : 0;

  // Skips first: pairs of positions (stash < pop), never the last layer
  // (it fixes the output's arity).
  std::map<int64_t, std::pair<bool, std::string>> skips;  // position -> (stash?, name)
  const int64_t pairs = total >= 3 ? d.in(0, std::min<int64_t>(3, (total - 1) / 2)) : 0;
  for (int64_t k = 0; k < pairs; ++k) {
    for (int tries = 0; tries < 20; ++tries) {
      const int64_t a = d.in(0, total - 2), b = d.in(0, total - 2);
      if (a == b || skips.contains(a) || skips.contains(b)) continue;
      const std::string name = "s" + std::to_string(k);
      skips[std::min(a, b)] = {true, name};
      skips[std::max(a, b)] = {false, name};
      break;
    }
  }

  int64_t arity = c.in_arity;
  for (int64_t i = 0; i < total; ++i) {
    LayerSpec l;
    l.arity = arity;
    const bool last = i == total - 1;
    if (auto it = skips.find(i); it != skips.end()) {
      const bool is_stash = it->second.first;
      l.skip = it->second.second;
      l.kind = arity == 0 ? (is_stash ? Kind::Stash : Kind::Pop)
                          : (is_stash ? Kind::TStash : Kind::TPop);
      if (l.kind == Kind::TStash) l.which = d.in(0, 2);
    } else if (last && !tuple_io && arity > 0) {
      l.kind = Kind::Join;
    } else if (last && tuple_io && arity == 0) {
      l.kind = Kind::Fork;
    } else if (arity == 0) {
      std::vector<Kind> kinds{Kind::Linear, Kind::Tanh, Kind::Linear};
      if (!last) kinds.push_back(Kind::Fork);  // a tensor-in model ends on one tensor
      l.kind = d.pick(kinds);
    } else {
      std::vector<Kind> kinds{Kind::Mix, Kind::TTanh, Kind::Mix};
      if (arity < widest) kinds.push_back(Kind::Split);
      if (2 * arity <= widest) kinds.push_back(Kind::Widen);
      if (arity > 1) kinds.push_back(Kind::Merge);
      if (!last || !tuple_io) kinds.push_back(Kind::Join);
      l.kind = d.pick(kinds);
    }
    switch (l.kind) {
      case Kind::Fork: arity = 2; break;
      case Kind::Join: arity = 0; break;
      case Kind::Split: arity += 1; break;
      case Kind::Widen: arity *= 2; break;
      case Kind::Merge: arity -= 1; break;
      default: break;
    }
    c.widest = std::max(c.widest, arity);
    c.layers.push_back(l);
  }
  c.out_arity = arity;
  // A quarter of the models tie two of their one-tensor Linear layers'
  // weights (on one stage, two stages or two ranks, as the balance falls).
  if (d.chance(25)) {
    std::vector<size_t> linears;
    for (size_t i = 0; i < c.layers.size(); ++i) {
      if (c.layers[i].kind == Kind::Linear && c.layers[i].arity == 0) linears.push_back(i);
    }
    if (linears.size() >= 2) {
      const auto a = static_cast<size_t>(d.in(0, static_cast<int64_t>(linears.size()) - 1));
      auto b = static_cast<size_t>(d.in(0, static_cast<int64_t>(linears.size()) - 2));
      if (b >= a) ++b;
      c.layers[linears[a]].kind = Kind::Tied;
      c.layers[linears[b]].kind = Kind::Tied;
    }
  }
  // A model of Tanh and TTanh only has nothing to train (the plain loss
  // would not require grad): give its first layer parameters.
  if (std::all_of(c.layers.begin(), c.layers.end(), [](const LayerSpec& l) {
        return l.kind == Kind::Tanh || l.kind == Kind::TTanh;
      })) {
    c.layers[0].kind = c.layers[0].arity == 0 ? Kind::Linear : Kind::Mix;
  }

  // Steps: one shape throughout, A B A (changing back), each its own, or
  // A B A where B has another number of dims (2-D vs 3-D values).
  const int64_t steps = d.in(1, 3);
  const bool three_d = d.chance(60);
  auto shape = [&](bool with_seq) {
    return StepShape{d.in(c.chunks, c.chunks + 5), with_seq ? d.in(1, 4) : 0};
  };
  const StepShape a = shape(three_d);
  const int64_t pattern = d.in(0, 3);
  StepShape b = shape(pattern == 3 ? !three_d : three_d);
  if (pattern == 1 && b.rows == a.rows && b.seq == a.seq) b.rows = a.rows + 1;
  for (int64_t s = 0; s < steps; ++s) {
    if (pattern == 0) c.steps.push_back(a);
    else if (pattern == 2) c.steps.push_back(s == 0 ? a : shape(three_d));
    else c.steps.push_back(s % 2 == 0 ? a : b);
  }

  // Tables and per-stage modes: a generator of their own (the draws above
  // stay as they were before these existed).
  Draw extra(seed ^ 0x7AB1E5EEDULL);
  const int64_t stages_now = static_cast<int64_t>(c.balance.size());
  if (extra.chance(30)) {
    c.v_shaped = c.virtual_stages == 2 && (c.schedule == Schedule::ZBV || extra.chance(50));
    c.table = random_table(extra, stages_now, c.ranks, c.chunks, c.v_shaped);
  } else {
    c.v_shaped = c.schedule == Schedule::ZBV;
  }
  if (extra.chance(25)) {
    for (int64_t j = 0; j < stages_now; ++j) {
      c.stage_modes.push_back(extra.pick(std::vector<Checkpoint>{
          Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}));
    }
  }
  return c;
}

// The same values on every call: a model with tied layers cannot be
// cloned (clone() unties them), so each user builds its own.
torch::nn::Sequential build_model(const Config& c) {
  torch::manual_seed(c.seed);
  const auto tied = (randn64({kWidth, kWidth}) * 0.5).requires_grad_(true);
  torch::nn::Sequential m;
  for (const auto& l : c.layers) {
    switch (l.kind) {
      case Kind::Linear: m->push_back(linear64()); break;
      case Kind::Tanh: m->push_back(torch::nn::Tanh()); break;
      case Kind::Stash: m->push_back(Stash(l.skip)); break;
      case Kind::Pop: m->push_back(Pop(l.skip)); break;
      case Kind::Fork: m->push_back(Fork()); break;
      case Kind::Join: m->push_back(Join()); break;
      case Kind::Mix: m->push_back(Mix(l.arity)); break;
      case Kind::TTanh: m->push_back(TTanh()); break;
      case Kind::Split: m->push_back(Split()); break;
      case Kind::Widen: m->push_back(Widen()); break;
      case Kind::Merge: m->push_back(Merge()); break;
      case Kind::TStash: m->push_back(TStash(l.skip, l.which)); break;
      case Kind::TPop: m->push_back(TPop(l.skip)); break;
      case Kind::Tied: m->push_back(Tied(tied)); break;
    }
  }
  return m;
}

// One step's data: inputs (one tensor when in_arity is 0) and targets.
struct StepData {
  Tensors inputs;
  Tensors targets;
};

Tensors draw_tensors(int64_t arity, const StepShape& s) {
  std::vector<int64_t> sizes{s.rows};
  if (s.seq) sizes.push_back(s.seq);
  sizes.push_back(kWidth);
  Tensors t;
  for (int64_t k = 0; k < std::max<int64_t>(arity, 1); ++k) t.push_back(randn64(sizes));
  return t;
}

torch::Tensor tuple_loss(const Tensors& out, const Tensors& t) {
  auto loss = torch::mse_loss(out[0], t[0]);
  for (size_t k = 1; k < out.size(); ++k) loss = loss + torch::mse_loss(out[k], t[k]) / (1.0 + k);
  return loss;
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); }

// The plain Sequential's outputs (as a list) for one step's inputs.
Tensors plain_forward(const Config& c, torch::nn::Sequential& m, const Tensors& inputs) {
  if (c.in_arity == 0) {
    if (c.out_arity == 0) return {m->forward(inputs[0])};
    return m->forward<Tensors>(inputs[0]);
  }
  if (c.out_arity == 0) return {m->forward(inputs)};
  return m->forward<Tensors>(inputs);
}

torch::Tensor plain_loss(const Config& c, const Tensors& out, const Tensors& targets) {
  return c.out_arity == 0 ? mse(out[0], targets[0]) : tuple_loss(out, targets);
}

// An error message without torch's backtrace.
std::string without_backtrace(std::string m) {
  if (const auto at = m.find("\nException raised from"); at != std::string::npos) m.resize(at);
  return m;
}

using Grads = std::map<std::string, torch::Tensor>;

Grads grads_of(const torch::nn::Module& m) {
  Grads g;
  for (const auto& p : m.named_parameters()) {
    g[p.key()] = p.value().grad().defined() ? p.value().grad().clone() : torch::Tensor();
  }
  return g;
}

// What one rank's step gave.
struct RankStep {
  torch::Tensor loss;
  Tensors eval;
  Grads grads;
};

// Runs one configuration; returns "" or what differed / failed.
std::string run_config(const Config& c) {
  std::ostringstream problems;
  int reported = 0;
  auto problem = [&](const std::string& what) {
    if (++reported <= 25) problems << "\n  " << what;
  };
  auto close = [&](const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
    const double d = max_abs_diff(got, want);
    if (!(d <= kTolerance)) {
      std::ostringstream s;
      s << what << ": max |diff| " << d;
      if (got.defined() && want.defined() && got.sizes() != want.sizes()) {
        s << " (shapes " << got.sizes() << " vs " << want.sizes() << ")";
      }
      problem(s.str());
    }
  };

  std::vector<StepData> data;
  torch::manual_seed(c.seed + 1000003);
  for (const auto& s : c.steps) {
    data.push_back({draw_tensors(c.in_arity, s), draw_tensors(c.out_arity, s)});
  }

  // The plain Sequential and Pipe, step by step (grads accumulate).
  auto plain = build_model(c);
  auto pipe_model = build_model(c);
  gpipe::Pipe pipe(pipe_model,
                   gpipe::PipeOptions()
                       .balance(c.balance)
                       .devices(std::vector<c10::Device>(static_cast<size_t>(c.ranks), torch::kCPU))
                       .chunks(c.chunks)
                       .schedule(c.schedule)
                       .virtual_stages(c.virtual_stages)
                       .checkpoint(c.checkpoint)
                       .stage_checkpoints(c.stage_modes)
                       .schedule_csv(c.table));
  std::vector<torch::Tensor> plain_losses, pipe_losses;
  std::vector<Tensors> plain_outs;
  std::vector<Grads> plain_grads, pipe_grads;
  for (const auto& step : data) {
    auto loss = plain_loss(c, plain_forward(c, plain, step.inputs), step.targets);
    loss.backward();
    plain_losses.push_back(loss.detach());
    plain_grads.push_back(grads_of(*plain));
    {
      torch::NoGradGuard no_grad;
      plain_outs.push_back(plain_forward(c, plain, step.inputs));
    }
    if (c.in_arity == 0 && c.out_arity == 0) {
      pipe_losses.push_back(pipe->train_step(step.inputs[0], step.targets[0], mse));
    } else {
      pipe_losses.push_back(pipe->train_step_tuple(step.inputs, step.targets, tuple_loss));
    }
    pipe_grads.push_back(grads_of(*pipe));
  }

  // The distributed pipe: every rank runs every step, then an eval.
  std::vector<torch::nn::Sequential> copies;
  for (int r = 0; r < c.ranks; ++r) copies.push_back(build_model(c));
  const auto groups = make_fake_groups(c.ranks, c.matching, 10s);
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> reverse;
  if (c.matching == FakeMatching::ByOrder) reverse = make_fake_groups(c.ranks, c.matching, 10s);
  std::vector<std::vector<RankStep>> results(static_cast<size_t>(c.ranks));
  std::vector<char> lasts(static_cast<size_t>(c.ranks), 0);
  const auto errors = run_ranks(c.ranks, [&](int rank) {
    const auto r = static_cast<size_t>(rank);
    auto options = gpipe::DistributedPipeOptions(c.balance)
                       .chunks(c.chunks)
                       .schedule(c.schedule)
                       .virtual_stages(c.virtual_stages)
                       .checkpoint(c.checkpoint)
                       .stage_checkpoints(c.stage_modes)
                       .schedule_csv(c.table)
                       .group(groups[r]);
    if (!reverse.empty()) options.reverse_group(reverse[r]);
    gpipe::DistributedPipe dp(copies[r], options);
    lasts[r] = dp->is_last();
    for (const auto& step : data) {
      RankStep out;
      const auto in = dp->is_first() ? step.inputs : Tensors{};
      const auto target = dp->is_last() ? step.targets : Tensors{};
      if (c.in_arity == 0 && c.out_arity == 0) {
        out.loss = dp->train_step(in.empty() ? torch::Tensor() : in[0],
                                  target.empty() ? torch::Tensor() : target[0], mse);
      } else {
        out.loss = dp->train_step_tuple(in, target, tuple_loss);
      }
      out.grads = grads_of(*dp);
      if (c.in_arity == 0 && c.out_arity == 0) {
        auto e = dp->eval_step(in.empty() ? torch::Tensor() : in[0]);
        if (e.defined()) out.eval = {e};
      } else {
        out.eval = dp->eval_step_tuple(in);
      }
      results[r].push_back(std::move(out));
    }
  });
  for (int r = 0; r < c.ranks; ++r) {
    if (!errors[static_cast<size_t>(r)].empty()) {
      problem("rank " + std::to_string(r) + " failed: " +
              without_backtrace(errors[static_cast<size_t>(r)]));
    }
  }
  if (reported > 0) return problems.str();

  for (size_t s = 0; s < data.size(); ++s) {
    const std::string after = "after step " + std::to_string(s + 1) + ": ";
    close(pipe_losses[s], plain_losses[s], after + "Pipe's loss vs the plain Sequential's");
    std::map<std::string, int> holders;
    // The last stage's rank: the last rank, or rank 0 under ZB-V's V.
    const int last_rank = c.v_shaped ? 0 : c.ranks - 1;
    for (int r = 0; r < c.ranks; ++r) {
      const auto& out = results[static_cast<size_t>(r)][s];
      const std::string who = after + "rank " + std::to_string(r) + " ";
      if (lasts[static_cast<size_t>(r)] != (r == last_rank)) problem(who + "is_last is wrong");
      if (r == last_rank) {
        close(out.loss, plain_losses[s], who + "loss vs the plain Sequential's");
        close(out.loss, pipe_losses[s], who + "loss vs Pipe's");
        if (out.eval.size() != plain_outs[s].size()) {
          problem(who + "eval gave " + std::to_string(out.eval.size()) + " outputs, want " +
                  std::to_string(plain_outs[s].size()));
        } else {
          for (size_t k = 0; k < out.eval.size(); ++k) {
            close(out.eval[k], plain_outs[s][k], who + "eval output " + std::to_string(k));
          }
        }
      } else {
        if (out.loss.defined()) problem(who + "returned a loss (only the last rank should)");
        if (!out.eval.empty()) problem(who + "returned eval outputs (only the last rank should)");
      }
      for (const auto& [name, grad] : out.grads) {
        ++holders[name];
        if (!plain_grads[s].contains(name)) {
          problem(who + "has parameter " + name + ", which the Sequential lacks");
          continue;
        }
        close(grad, plain_grads[s].at(name), who + "grad of " + name + " vs the plain Sequential's");
        close(grad, pipe_grads[s].at(name), who + "grad of " + name + " vs Pipe's");
      }
    }
    for (const auto& [name, grad] : plain_grads[s]) {
      if (holders[name] != 1) {
        problem(after + "parameter " + name + " is on " + std::to_string(holders[name]) +
                " ranks, want 1");
      }
      close(pipe_grads[s].at(name), grad,
            after + "Pipe's grad of " + name + " vs the plain Sequential's");
    }
  }
  return problems.str();
}

std::pair<uint64_t, uint64_t> seed_range() {
  const char* env = std::getenv("GPIPE_DIST_FUZZ_SEEDS");
  if (env == nullptr || *env == '\0') return {0, kDefaultSeeds};
  const std::string s(env);
  const auto colon = s.find(':');
  if (colon == std::string::npos) {
    throw std::invalid_argument("GPIPE_DIST_FUZZ_SEEDS='" + s +
                                "' is not a range; write first:end, e.g. 0:500 (end excluded)");
  }
  const uint64_t a = std::stoull(s.substr(0, colon)), b = std::stoull(s.substr(colon + 1));
  if (b <= a) {
    throw std::invalid_argument("GPIPE_DIST_FUZZ_SEEDS='" + s + "' is empty; the end (" +
                                std::to_string(b) + ") must exceed the first seed (" +
                                std::to_string(a) + ")");
  }
  return {a, b};
}

}  // namespace

TEST_CASE("distributed_pipe fuzz: random pipelines, shapes and schedules equal Pipe and the "
          "plain Sequential after every step",
          "[distributed][fuzz]") {
  const auto [first, end] = seed_range();
  const char* verbose = std::getenv("GPIPE_DIST_FUZZ_VERBOSE");
  int failed = 0;
  for (uint64_t seed = first; seed < end; ++seed) {
    const auto config = draw_config(seed);
    if (verbose != nullptr && *verbose != '\0' && *verbose != '0') {
      std::cout << describe(config) << std::endl;
    }
    std::string problems;
    try {
      problems = run_config(config);
    } catch (const std::exception& e) {
      problems = "\n  threw on the main thread: " + without_backtrace(e.what());
    }
    if (!problems.empty()) {
      ++failed;
      FAIL_CHECK(describe(config) << problems);
    }
  }
  INFO("seeds " << first << ".." << end - 1);
  CHECK(failed == 0);
}
