// plan.cpp — the training-step plans as data: the four generators, the validator, the simulation, the picture.
#include "plan.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace gpipe::detail {

namespace {

constexpr char kOpLetter[] = {'F', 'B', 'I', 'W'};

char letter(Op op) { return kOpLetter[static_cast<size_t>(op)]; }

size_t at(int64_t n) { return static_cast<size_t>(n); }

void require_count(const char* name, int64_t value) {
  if (value < 1) {
    throw std::invalid_argument(std::string(name) + " is " + std::to_string(value) +
                                " but a plan needs at least 1; pass " + name + " >= 1");
  }
}

Plan empty_plan(PlanKind kind, int64_t workers, int64_t virtual_stages, int64_t microbatches) {
  require_count("workers", workers);
  require_count("virtual_stages", virtual_stages);
  require_count("microbatches", microbatches);
  Plan plan;
  plan.kind = kind;
  plan.workers = workers;
  plan.stages = workers * virtual_stages;
  plan.microbatches = microbatches;
  plan.lists.resize(at(workers));
  return plan;
}

// ---- the structure: every task in range, on its worker, once ----------------

// Per (stage, micro-batch): whether its backward is split into I and W, so a
// dependency on "the backward of (s+1, i)" knows which task to wait for.
using Split = std::vector<std::vector<bool>>;

std::string where(int64_t worker, size_t position) {
  return "worker " + std::to_string(worker) + "'s task " + std::to_string(position);
}

Split check_structure(const Plan& plan) {
  if (plan.workers < 1) {
    throw std::invalid_argument("plan has " + std::to_string(plan.workers) +
                                " workers; a plan needs at least 1");
  }
  if (plan.microbatches < 1) {
    throw std::invalid_argument("plan has " + std::to_string(plan.microbatches) +
                                " micro-batches; a plan needs at least 1");
  }
  if (plan.stages < plan.workers || plan.stages % plan.workers != 0) {
    throw std::invalid_argument("plan has " + std::to_string(plan.stages) + " stages on " +
                                std::to_string(plan.workers) +
                                " workers; stages must be a positive multiple of workers "
                                "(virtual stages per worker times workers)");
  }
  if (static_cast<int64_t>(plan.lists.size()) != plan.workers) {
    throw std::invalid_argument("plan has " + std::to_string(plan.lists.size()) + " lists for " +
                                std::to_string(plan.workers) +
                                " workers; give one list per worker");
  }
  if (!plan.placement.empty()) {
    if (static_cast<int64_t>(plan.placement.size()) != plan.stages) {
      throw std::invalid_argument("plan places " + std::to_string(plan.placement.size()) +
                                  " stages but has " + std::to_string(plan.stages) +
                                  "; give one worker per stage");
    }
    std::vector<int64_t> held(at(plan.workers), 0);
    for (size_t s = 0; s < plan.placement.size(); ++s) {
      const int64_t w = plan.placement[s];
      if (w < 0 || w >= plan.workers) {
        throw std::invalid_argument("plan places stage " + std::to_string(s) + " on worker " +
                                    std::to_string(w) + " of " + std::to_string(plan.workers));
      }
      ++held[at(w)];
    }
    const int64_t each = plan.stages / plan.workers;
    for (int64_t w = 0; w < plan.workers; ++w) {
      if (held[at(w)] != each) {
        throw std::invalid_argument("plan places " + std::to_string(held[at(w)]) +
                                    " stages on worker " + std::to_string(w) + "; every worker "
                                    "holds the same number (" + std::to_string(each) + ")");
      }
    }
  }
  const size_t stages = at(plan.stages);
  const size_t m = at(plan.microbatches);
  // seen[op][stage][micro-batch]: where the task first appears, or none.
  struct Seen {
    int64_t worker = -1;
    size_t position = 0;
  };
  std::vector<std::vector<std::vector<Seen>>> seen(
      4, std::vector<std::vector<Seen>>(stages, std::vector<Seen>(m)));
  for (int64_t w = 0; w < plan.workers; ++w) {
    const auto& list = plan.lists[at(w)];
    for (size_t k = 0; k < list.size(); ++k) {
      const Task& t = list[k];
      if (t.stage < 0 || t.stage >= plan.stages) {
        throw std::invalid_argument(where(w, k) + ", " + describe(t) + ": stage " +
                                    std::to_string(t.stage) + " is out of range for a plan of " +
                                    std::to_string(plan.stages) + " stages");
      }
      if (t.microbatch < 0 || t.microbatch >= plan.microbatches) {
        throw std::invalid_argument(where(w, k) + ", " + describe(t) + ": micro-batch " +
                                    std::to_string(t.microbatch) +
                                    " is out of range for a plan of " +
                                    std::to_string(plan.microbatches) + " micro-batches");
      }
      if (plan.worker_of(t.stage) != w) {
        throw std::invalid_argument(describe(t) + " is in worker " + std::to_string(w) +
                                    "'s list but stage " + std::to_string(t.stage) +
                                    " runs on worker " + std::to_string(plan.worker_of(t.stage)) +
                                    (plan.placement.empty()
                                         ? " (stage mod " + std::to_string(plan.workers) + ")"
                                         : std::string(" (the plan's placement)")) +
                                    "; move it to that worker's list");
      }
      Seen& s = seen[static_cast<size_t>(t.op)][at(t.stage)][at(t.microbatch)];
      if (s.worker >= 0) {
        throw std::invalid_argument(describe(t) + " appears twice, as " +
                                    where(s.worker, s.position) + " and " + where(w, k) +
                                    "; each task runs once");
      }
      s = {w, k};
    }
  }
  Split split(stages, std::vector<bool>(m, false));
  auto has = [&](Op op, size_t s, size_t i) {
    return seen[static_cast<size_t>(op)][s][i].worker >= 0;
  };
  for (size_t s = 0; s < stages; ++s) {
    for (size_t i = 0; i < m; ++i) {
      auto task = [&](Op op) {
        return describe({op, static_cast<int64_t>(s), static_cast<int64_t>(i)});
      };
      const std::string need =
          "; each (stage, micro-batch) needs one F and either one B or one I and one W";
      if (!has(Op::F, s, i)) throw std::invalid_argument(task(Op::F) + " is missing" + need);
      const bool b = has(Op::B, s, i);
      const bool in = has(Op::I, s, i);
      const bool wt = has(Op::W, s, i);
      if (b && (in || wt)) {
        throw std::invalid_argument(task(Op::B) + " and " + task(in ? Op::I : Op::W) +
                                    " both appear; a backward runs whole (B) or split "
                                    "(I then W), not both" +
                                    std::string(in ? "" : " (older torch.distributed.pipelining "
                                                "tables wrote the input half as B: write that "
                                                "B as I)"));
      }
      if (!b && !in && !wt) throw std::invalid_argument(task(Op::B) + " is missing" + need);
      if (!b && !in) throw std::invalid_argument(task(Op::I) + " is missing" + need);
      if (!b && !wt) throw std::invalid_argument(task(Op::W) + " is missing" + need);
      split[s][i] = !b;
    }
  }
  return split;
}

// ---- the run: each worker in list order, each task when its inputs are there --

struct Run {
  std::vector<std::vector<double>> start;
  double makespan = 0;
};

// The tasks `task` waits for (at most two), per the edges in plan.h.
int dependencies(const Plan& plan, const Split& split, const Task& task, Task out[2]) {
  const int64_t s = task.stage;
  const int64_t i = task.microbatch;
  switch (task.op) {
    case Op::F:
      if (s == 0) return 0;
      out[0] = {Op::F, s - 1, i};
      return 1;
    case Op::B:
    case Op::I:
      out[0] = {Op::F, s, i};
      if (s + 1 == plan.stages) return 1;
      out[1] = {split[at(s + 1)][at(i)] ? Op::I : Op::B, s + 1, i};
      return 2;
    case Op::W:
      out[0] = {Op::I, s, i};
      return 1;
  }
  return 0;
}

double duration(Op op, const Costs& costs) {
  switch (op) {
    case Op::F: return costs.f;
    case Op::B: return costs.b;
    case Op::I: return costs.i;
    case Op::W: return costs.w;
  }
  return 0;
}

// Sweeps the workers, moving each as far down its list as its inputs allow,
// until all are done or none can move: then the plan deadlocks, and the
// error names what each stuck worker waits for. A start time only depends on
// tasks that ended before, so the sweep order does not change the times.
Run run(const Plan& plan, const Split& split, const Costs& costs) {
  constexpr double kPending = -1;
  const size_t stages = at(plan.stages);
  const size_t m = at(plan.microbatches);
  std::vector<std::vector<std::vector<double>>> end(
      4, std::vector<std::vector<double>>(stages, std::vector<double>(m, kPending)));
  auto end_of = [&](const Task& t) -> double& {
    return end[static_cast<size_t>(t.op)][at(t.stage)][at(t.microbatch)];
  };
  const size_t workers = at(plan.workers);
  Run result;
  result.start.resize(workers);
  std::vector<size_t> next(workers, 0);
  std::vector<double> free_at(workers, 0);
  size_t remaining = 0;
  for (const auto& list : plan.lists) remaining += list.size();

  while (remaining > 0) {
    bool progressed = false;
    for (size_t w = 0; w < workers; ++w) {
      const auto& list = plan.lists[w];
      while (next[w] < list.size()) {
        const Task& t = list[next[w]];
        Task deps[2];
        const int n = dependencies(plan, split, t, deps);
        double ready = free_at[w];
        bool blocked = false;
        for (int d = 0; d < n; ++d) {
          const double e = end_of(deps[d]);
          if (e == kPending) {
            blocked = true;
            break;
          }
          ready = std::max(ready, e);
        }
        if (blocked) break;
        result.start[w].push_back(ready);
        free_at[w] = ready + duration(t.op, costs);
        end_of(t) = free_at[w];
        result.makespan = std::max(result.makespan, free_at[w]);
        ++next[w];
        --remaining;
        progressed = true;
      }
    }
    if (progressed) continue;
    std::string message = "plan deadlocks, every unfinished worker waits:";
    for (size_t w = 0; w < workers; ++w) {
      const auto& list = plan.lists[w];
      if (next[w] == list.size()) continue;
      const Task& t = list[next[w]];
      Task deps[2];
      const int n = dependencies(plan, split, t, deps);
      for (int d = 0; d < n; ++d) {
        if (end_of(deps[d]) != kPending) continue;
        const auto owner = plan.worker_of(deps[d].stage);
        message += " worker " + std::to_string(w) + " at " + describe(t) + " for " +
                   describe(deps[d]) +
                   (at(owner) == w ? " (later in its own list);"
                                   : " (worker " + std::to_string(owner) + ");");
        break;
      }
    }
    throw std::invalid_argument(message +
                                " reorder the lists so that each task's inputs can run first");
  }
  return result;
}

void check_costs(const Costs& costs) {
  for (auto [name, value] : {std::pair{"f", costs.f}, std::pair{"b", costs.b},
                             std::pair{"i", costs.i}, std::pair{"w", costs.w}}) {
    if (!std::isfinite(value) || value < 0) {
      std::ostringstream out;
      out << "cost " << name << " is " << value << "; durations must be finite and >= 0";
      throw std::invalid_argument(out.str());
    }
  }
}

// The interleaved schedule's micro-batch groups, [first, last) each: groups
// of `workers` (a group leaves a worker through one chunk and is back, on the
// next chunk, just as the group is done), and when M is not a multiple of W
// the remainder joins the last group. A short group of its own would send
// its micro-batches round to the next chunk faster than the pipeline turns,
// so a worker would wait for a forward while its neighbour waits on it for a
// backward: such plans deadlock (W=4, v=3, M=5 does).
std::vector<std::pair<int64_t, int64_t>> groups(int64_t workers, int64_t microbatches) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t first = 0, last = 0; first < microbatches; first = last) {
    last = std::min(first + workers, microbatches);
    if (microbatches - last < workers) last = microbatches;
    out.emplace_back(first, last);
  }
  return out;
}

// One worker's (local stage, micro-batch) pairs in the order it runs their
// forwards: each group through local stage 0, then 1, ...; backwards run in
// the same order with the local stages reversed.
std::vector<std::pair<int64_t, int64_t>> chunk_order(
    const std::vector<std::pair<int64_t, int64_t>>& groups, int64_t virtual_stages,
    bool backward) {
  std::vector<std::pair<int64_t, int64_t>> order;
  for (const auto& [first, last] : groups) {
    for (int64_t c = 0; c < virtual_stages; ++c) {
      const int64_t chunk = backward ? virtual_stages - 1 - c : c;
      for (int64_t i = first; i < last; ++i) order.emplace_back(chunk, i);
    }
  }
  return order;
}

}  // namespace

std::ostream& operator<<(std::ostream& out, const Task& task) {
  return out << letter(task.op) << task.microbatch;
}

std::string describe(const Task& task) {
  return std::string(1, letter(task.op)) + "(stage " + std::to_string(task.stage) +
         ", micro-batch " + std::to_string(task.microbatch) + ")";
}

std::string to_string(PlanKind kind) {
  switch (kind) {
    case PlanKind::GPipe: return "gpipe";
    case PlanKind::OneFOneB: return "1f1b";
    case PlanKind::Interleaved1F1B: return "interleaved_1f1b";
    case PlanKind::ZBH1: return "zb_h1";
    case PlanKind::Custom: return "custom";
    case PlanKind::ZBV: return "zb_v";
  }
  return "unknown";
}

bool Plan::loop_placement() const noexcept {
  for (size_t s = 0; s < placement.size(); ++s) {
    if (placement[s] != static_cast<int64_t>(s) % workers) return false;
  }
  return true;
}

std::vector<int64_t> v_placement(int64_t workers) {
  std::vector<int64_t> placement;
  for (int64_t s = 0; s < 2 * workers; ++s) placement.push_back(s < workers ? s : 2 * workers - 1 - s);
  return placement;
}

std::vector<int64_t> placement_of(PlanKind kind, int64_t workers, int64_t virtual_stages) {
  if (kind == PlanKind::ZBV) return v_placement(workers);
  std::vector<int64_t> loop;
  for (int64_t s = 0; s < workers * virtual_stages; ++s) loop.push_back(s % workers);
  return loop;
}

Plan gpipe_plan(int64_t workers, int64_t microbatches) {
  Plan plan = empty_plan(PlanKind::GPipe, workers, 1, microbatches);
  for (int64_t w = 0; w < workers; ++w) {
    auto& list = plan.lists[at(w)];
    for (int64_t i = 0; i < microbatches; ++i) list.push_back({Op::F, w, i});
    for (int64_t i = microbatches - 1; i >= 0; --i) list.push_back({Op::B, w, i});
  }
  return plan;
}

Plan one_f_one_b_plan(int64_t workers, int64_t microbatches) {
  Plan plan = empty_plan(PlanKind::OneFOneB, workers, 1, microbatches);
  for (int64_t w = 0; w < workers; ++w) {
    auto& list = plan.lists[at(w)];
    // Enough forwards in flight that micro-batch 0's backward arrives from
    // the last worker just as this one would start idling; later workers
    // need fewer. Never more than there are micro-batches.
    const int64_t warmup = std::min(workers - w - 1, microbatches);
    for (int64_t i = 0; i < warmup; ++i) list.push_back({Op::F, w, i});
    for (int64_t k = 0; k + warmup < microbatches; ++k) {
      list.push_back({Op::F, w, k + warmup});
      list.push_back({Op::B, w, k});
    }
    for (int64_t k = microbatches - warmup; k < microbatches; ++k) list.push_back({Op::B, w, k});
  }
  return plan;
}

Plan interleaved_1f1b_plan(int64_t workers, int64_t virtual_stages, int64_t microbatches) {
  Plan plan = empty_plan(PlanKind::Interleaved1F1B, workers, virtual_stages, microbatches);
  const auto grouped = groups(workers, microbatches);
  const auto forward = chunk_order(grouped, virtual_stages, /*backward=*/false);
  const auto backward = chunk_order(grouped, virtual_stages, /*backward=*/true);
  const auto total = static_cast<int64_t>(forward.size());
  int64_t largest = 0;
  for (const auto& [first, last] : grouped) largest = std::max(largest, last - first);
  for (int64_t w = 0; w < workers; ++w) {
    auto& list = plan.lists[at(w)];
    auto stage = [&](int64_t chunk) { return chunk * workers + w; };
    // Megatron's warm-up: a worker's first backward of a group is on its last
    // chunk, so the group must have been through every other chunk first
    // ((v-1) times the group), plus two per worker downstream (a forward and
    // a backward hop each). With one chunk this is plain 1F1B, which needs
    // one per worker downstream.
    const int64_t warmup =
        virtual_stages == 1
            ? std::min(workers - w - 1, total)
            : std::min((workers - w - 1) * 2 + (virtual_stages - 1) * largest, total);
    for (int64_t k = 0; k < warmup; ++k) {
      list.push_back({Op::F, stage(forward[at(k)].first), forward[at(k)].second});
    }
    for (int64_t k = 0; k + warmup < total; ++k) {
      const auto& f = forward[at(k + warmup)];
      list.push_back({Op::F, stage(f.first), f.second});
      list.push_back({Op::B, stage(backward[at(k)].first), backward[at(k)].second});
    }
    for (int64_t k = total - warmup; k < total; ++k) {
      list.push_back({Op::B, stage(backward[at(k)].first), backward[at(k)].second});
    }
  }
  return plan;
}

Plan zb_h1_plan(int64_t workers, int64_t microbatches) {
  Plan plan = empty_plan(PlanKind::ZBH1, workers, 1, microbatches);
  // ZB-H1 (Qi et al., ICLR 2024), laid out tick by tick with every task one
  // tick. Its memory budget is 1F1B's peak, the peak over all workers:
  // 1F1B's worker 0 holds min(W, M) micro-batches in flight, so every worker
  // may, a micro-batch counting from its F until its W (I still needs the
  // activations, W needs what I kept). Worker 0 has no room to spare and
  // runs each W right after its I, as 1F1B would its B; worker w's 1F1B
  // holds only W - w, so the budget leaves it room for w more: its W's may
  // lag behind its I's, the more the later the worker, and run where 1F1B
  // waits.
  //
  // Each worker runs 1F1B's F's and I's (its B's as I's) in 1F1B's order:
  // the same W - w - 1 warm-up forwards, then F and I in turn. Each tick it
  // runs the next of these if its inputs are there and, for an F, the budget
  // has room; otherwise the oldest W it owes, if any (a W waits on no other
  // worker, so it can always fill the tick); otherwise it idles. So W's run
  // when the budget requires (at worker 0 right after each I), in the gaps
  // where an F or I has not arrived yet, and, those still owed when the
  // forwards run out, in the drain, while the last I's hop back through the
  // workers at i a hop instead of 1F1B's b.
  //
  // The makespan (checked in test_plan.cpp, also for unequal costs with
  // w <= f + i) is the paper's M(f + i + w) + (W - 1)(f + i - w) when
  // M >= W: worker 0 idles only while its first I comes back, each later
  // worker pays for its late start with W's in the drain. With M < W
  // nothing fills the bubbles: micro-batch 0 reaches the last worker after
  // (W - 1)f, which runs F and I in turn for M(f + i), the last I hops back
  // in (W - 1)i and worker 0 ends with its W: (M + W - 1)(f + i) + w.
  const int64_t budget = std::min(workers, microbatches);
  struct Worker {
    std::vector<Task> order;    // 1F1B's F's and I's (B's as I's), in order
    size_t next = 0;
    int64_t held = 0;           // micro-batches from F until W
    std::vector<int64_t> owed;  // I's run whose W has not, oldest first
  };
  std::vector<Worker> ws(at(workers));
  const Plan one_f_one_b = one_f_one_b_plan(workers, microbatches);
  for (size_t w = 0; w < at(workers); ++w) {
    for (Task t : one_f_one_b.lists[w]) {
      if (t.op == Op::B) t.op = Op::I;
      ws[w].order.push_back(t);
    }
  }
  constexpr int64_t kPending = std::numeric_limits<int64_t>::max();
  // end[op][stage][micro-batch] in ticks (only F and I are ever waited on).
  std::vector<std::vector<std::vector<int64_t>>> end(
      4, std::vector<std::vector<int64_t>>(at(workers),
                                           std::vector<int64_t>(at(microbatches), kPending)));
  auto done_by = [&](Op op, int64_t s, int64_t i, int64_t tick) {
    return end[static_cast<size_t>(op)][at(s)][at(i)] <= tick;
  };
  auto ready = [&](const Task& t, int64_t tick) {
    if (t.op == Op::F) return t.stage == 0 || done_by(Op::F, t.stage - 1, t.microbatch, tick);
    return done_by(Op::F, t.stage, t.microbatch, tick) &&
           (t.stage + 1 == workers || done_by(Op::I, t.stage + 1, t.microbatch, tick));
  };
  const int64_t total = 3 * workers * microbatches;
  int64_t placed = 0;
  // Every tick some worker can move (1F1B's order has no cycle, and a
  // worker whose next F the budget holds back owes a W: 1F1B starts a
  // forward with at most min(W, M) - 1 others not yet through their
  // backward), so the loop ends well within this bound; the bound guards a
  // mistake here.
  for (int64_t tick = 0; placed < total; ++tick) {
    if (tick > total + 1) throw std::logic_error("zb_h1_plan: the layout made no progress");
    for (int64_t w = 0; w < workers; ++w) {
      Worker& me = ws[at(w)];
      Task t{};
      if (me.next < me.order.size() && ready(me.order[me.next], tick) &&
          (me.order[me.next].op != Op::F || me.held < budget)) {
        t = me.order[me.next++];
        if (t.op == Op::F) ++me.held;
        if (t.op == Op::I) me.owed.push_back(t.microbatch);
      } else if (!me.owed.empty()) {
        t = {Op::W, w, me.owed.front()};
        me.owed.erase(me.owed.begin());
        --me.held;
      } else {
        continue;
      }
      end[static_cast<size_t>(t.op)][at(w)][at(t.microbatch)] = tick + 1;
      plan.lists[at(w)].push_back(t);
      ++placed;
    }
  }
  return plan;
}

Plan zb_v_plan(int64_t workers, int64_t microbatches) {
  Plan plan = empty_plan(PlanKind::ZBV, workers, 2, microbatches);
  plan.placement = v_placement(workers);
  const int64_t stages = plan.stages;
  const int64_t budget = std::min(workers, microbatches);
  struct Worker {
    int64_t chunk[2];           // chunk 0 (the V going down), chunk 1 (coming back up)
    int64_t next_f[2] = {0, 0};  // the next micro-batch to forward, per chunk
    int64_t next_i[2] = {0, 0};  // the next micro-batch to backward (I), per chunk
    int64_t admitted = 0;       // chunk-0 micro-batches from F until W
    std::vector<Task> owed;     // I's run whose W has not, oldest first
  };
  std::vector<Worker> ws(at(workers));
  for (int64_t w = 0; w < workers; ++w) ws[at(w)].chunk[0] = w, ws[at(w)].chunk[1] = stages - 1 - w;
  constexpr int64_t kPending = std::numeric_limits<int64_t>::max();
  // end[op][stage][micro-batch] in ticks (F and I are waited on).
  std::vector<std::vector<std::vector<int64_t>>> end(
      2, std::vector<std::vector<int64_t>>(at(stages),
                                           std::vector<int64_t>(at(microbatches), kPending)));
  auto done_by = [&](int op, int64_t s, int64_t i, int64_t tick) {
    return end[at(op)][at(s)][at(i)] <= tick;
  };
  const int64_t total = 3 * stages * microbatches;
  int64_t placed = 0;
  // Every tick some worker can move: the oldest micro-batch not yet through
  // its backward always has a next task that is ready somewhere, and the
  // admission bound only holds back chunk-0 forwards (checked for W <= 8,
  // M <= 40 in test_plan.cpp); the bound guards a mistake here.
  for (int64_t tick = 0; placed < total; ++tick) {
    if (tick > total + 1) throw std::logic_error("zb_v_plan: the layout made no progress");
    for (int64_t w = 0; w < workers; ++w) {
      Worker& me = ws[at(w)];
      Task t{};
      bool found = false;
      // Input grads first, the oldest micro-batch, chunk 1 first on a tie
      // (its stage comes first on the backward's path).
      int best = -1;
      for (int c = 1; c >= 0; --c) {
        const int64_t s = me.chunk[c], i = me.next_i[c];
        if (i >= microbatches || !done_by(0, s, i, tick)) continue;
        if (s + 1 < stages && !done_by(1, s + 1, i, tick)) continue;
        if (best < 0 || i < me.next_i[best]) best = c;
      }
      if (best >= 0) {
        t = {Op::I, me.chunk[best], me.next_i[best]++};
        me.owed.push_back(t);
        found = true;
      }
      // Then forwards, likewise; chunk 0 only within the admission bound.
      best = -1;
      for (int c = 1; c >= 0 && !found; --c) {
        const int64_t s = me.chunk[c], i = me.next_f[c];
        if (i >= microbatches || (c == 0 && me.admitted >= budget)) continue;
        if (s > 0 && !done_by(0, s - 1, i, tick)) continue;
        if (best < 0 || i < me.next_f[best]) best = c;
      }
      if (!found && best >= 0) {
        t = {Op::F, me.chunk[best], me.next_f[best]++};
        if (best == 0) ++me.admitted;
        found = true;
      }
      if (!found && !me.owed.empty()) {
        t = {Op::W, me.owed.front().stage, me.owed.front().microbatch};
        me.owed.erase(me.owed.begin());
        if (t.stage == me.chunk[0]) --me.admitted;
        found = true;
      }
      if (!found) continue;
      if (t.op != Op::W) end[t.op == Op::F ? 0 : 1][at(t.stage)][at(t.microbatch)] = tick + 1;
      plan.lists[at(w)].push_back(t);
      ++placed;
    }
  }
  return plan;
}

Plan make_plan(PlanKind kind, int64_t workers, int64_t virtual_stages, int64_t microbatches) {
  if (kind == PlanKind::Interleaved1F1B) {
    return interleaved_1f1b_plan(workers, virtual_stages, microbatches);
  }
  if (kind == PlanKind::ZBV) {
    if (virtual_stages != 2) {
      throw std::invalid_argument("virtual_stages is " + std::to_string(virtual_stages) +
                                  " but schedule zb_v runs two stages per worker in a V; pass "
                                  "virtual_stages=2");
    }
    return zb_v_plan(workers, microbatches);
  }
  if (virtual_stages != 1) {
    throw std::invalid_argument("virtual_stages is " + std::to_string(virtual_stages) +
                                " but schedule " + to_string(kind) +
                                " runs one stage per worker; use interleaved_1f1b or "
                                "virtual_stages=1");
  }
  switch (kind) {
    case PlanKind::GPipe: return gpipe_plan(workers, microbatches);
    case PlanKind::OneFOneB: return one_f_one_b_plan(workers, microbatches);
    case PlanKind::ZBH1: return zb_h1_plan(workers, microbatches);
    case PlanKind::Interleaved1F1B:
    case PlanKind::ZBV: break;
    case PlanKind::Custom:
      throw std::invalid_argument("a custom plan is given as data (plan_from_csv), not made");
  }
  throw std::invalid_argument("unknown plan kind " +
                              std::to_string(static_cast<int>(kind)));
}

void validate(const Plan& plan) {
  const Split split = check_structure(plan);
  run(plan, split, Costs{1, 1, 1, 1});
}

namespace {

std::string trimmed(const std::string& s) {
  const auto first = s.find_first_not_of(" \t\r");
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(" \t\r") - first + 1);
}

// One cell of the CSV: "<stage><op><micro-batch>".
Task parse_action(const std::string& cell, size_t row, size_t column) {
  const std::string here = "row " + std::to_string(row) + ", cell " + std::to_string(column) +
                           " ('" + cell + "')";
  size_t k = 0;
  while (k < cell.size() && std::isdigit(static_cast<unsigned char>(cell[k]))) ++k;
  size_t end = k;
  while (end < cell.size() && !std::isdigit(static_cast<unsigned char>(cell[end]))) ++end;
  const std::string op = cell.substr(k, end - k);
  const std::string rest = cell.substr(end);
  const bool digits = !rest.empty() && std::all_of(rest.begin(), rest.end(), [](char c) {
    return std::isdigit(static_cast<unsigned char>(c));
  });
  static const std::vector<std::string> kOthers{"SEND_F", "RECV_F", "SEND_B", "RECV_B",
                                                "UNSHARD", "RESHARD", "REDUCE_GRAD"};
  if (k > 0 && std::find(kOthers.begin(), kOthers.end(), op) != kOthers.end()) {
    throw std::invalid_argument(here + ": " + op + " is not a compute action; give the compute "
                                "actions only (torch's 'compute_only' format: F, I, W, B), gpipe "
                                "derives the communication from them");
  }
  if (k == 0 || op.size() != 1 || std::string("FIWB").find(op[0]) == std::string::npos ||
      !digits || k > 9 || rest.size() > 9) {
    throw std::invalid_argument(here + " is not an action; write <stage><F|I|W|B><micro-batch>, "
                                "e.g. '0F3' (forward of micro-batch 3 on stage 0), '1I2', "
                                "'1W2', '0B1'");
  }
  const Op o = op[0] == 'F' ? Op::F : op[0] == 'I' ? Op::I : op[0] == 'W' ? Op::W : Op::B;
  return Task{o, std::stoll(cell.substr(0, k)), std::stoll(rest)};
}

// One cell: an action, or DualPipeV's overlapped pair "(<F action>;<B action>)OVERLAP_F_B",
// whose two actions gpipe runs one after the other, in the cell's order.
void parse_cell(const std::string& cell, size_t row, size_t column, std::vector<Task>& out) {
  if (cell.front() != '(') {
    out.push_back(parse_action(cell, row, column));
    return;
  }
  static const std::string kOverlap = ")OVERLAP_F_B";
  const bool closed = cell.size() > kOverlap.size() && cell.ends_with(kOverlap);
  const std::string body = closed ? cell.substr(1, cell.size() - kOverlap.size() - 1) : "";
  const auto semicolon = body.find(';');
  if (semicolon == std::string::npos || body.find(';', semicolon + 1) != std::string::npos) {
    throw std::invalid_argument("row " + std::to_string(row) + ", cell " +
                                std::to_string(column) + " ('" + cell +
                                "') is not an action nor an overlapped pair; write "
                                "(<action>;<action>)OVERLAP_F_B, e.g. '(0F7;7B3)OVERLAP_F_B'");
  }
  out.push_back(parse_action(trimmed(body.substr(0, semicolon)), row, column));
  out.push_back(parse_action(trimmed(body.substr(semicolon + 1)), row, column));
}

}  // namespace

Plan plan_from_csv(const std::string& text) {
  Plan plan;
  plan.kind = PlanKind::Custom;
  std::vector<std::string> rows;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) rows.push_back(line);
  while (!rows.empty() && trimmed(rows.back()).empty()) rows.pop_back();
  if (rows.empty()) {
    throw std::invalid_argument("the schedule CSV has no rows; give one row of actions per rank "
                                "(e.g. '0F0,0F1,0B0,0B1')");
  }
  for (size_t r = 0; r < rows.size(); ++r) {
    std::vector<Task> list;
    std::istringstream cells(rows[r]);
    size_t column = 0;
    for (std::string cell; std::getline(cells, cell, ','); ++column) {
      cell = trimmed(cell);
      if (cell.empty()) continue;  // an idle tick
      parse_cell(cell, r, column, list);
    }
    for (const Task& t : list) {
      plan.stages = std::max(plan.stages, t.stage + 1);
      plan.microbatches = std::max(plan.microbatches, t.microbatch + 1);
    }
    plan.lists.push_back(std::move(list));
  }
  plan.workers = static_cast<int64_t>(plan.lists.size());
  if (plan.stages % plan.workers != 0) {
    throw std::invalid_argument(
        "the schedule CSV names " + std::to_string(plan.stages) + " stages in " +
        std::to_string(plan.workers) + " rows; every row must hold as many stages, so the "
        "stages must be a multiple of the rows");
  }
  // The placement: the row each stage's tasks are in (one row per stage).
  plan.placement.assign(at(plan.stages), -1);
  for (size_t w = 0; w < plan.lists.size(); ++w) {
    for (const Task& t : plan.lists[w]) {
      int64_t& row = plan.placement[at(t.stage)];
      if (row < 0) row = static_cast<int64_t>(w);
      if (row == static_cast<int64_t>(w)) continue;
      throw std::invalid_argument(describe(t) + " is in row " + std::to_string(w) + ", but stage " +
                                  std::to_string(t.stage) + " has tasks in row " +
                                  std::to_string(row) + " too; a stage runs on one row");
    }
  }
  for (size_t s = 0; s < plan.placement.size(); ++s) {
    if (plan.placement[s] < 0) {
      throw std::invalid_argument("the schedule CSV names stages up to " +
                                  std::to_string(plan.stages - 1) + " but none of stage " +
                                  std::to_string(s) + "'s actions; give each stage's F and B "
                                  "(or I and W) for every micro-batch");
    }
  }
  if (plan.loop_placement()) plan.placement.clear();
  validate(plan);
  return plan;
}

bool v_placed(const Plan& plan) {
  return plan.stages == 2 * plan.workers && plan.placement == v_placement(plan.workers);
}

void require_runnable_placement(const Plan& plan) {
  if (v_placed(plan)) return;
  for (int64_t s = 0; s < plan.stages; ++s) {
    if (plan.worker_of(s) == s % plan.workers) continue;
    const std::string w = std::to_string(plan.workers);
    throw std::invalid_argument(
        "the schedule runs stage " + std::to_string(s) + " on row " +
        std::to_string(plan.worker_of(s)) + ", but gpipe runs stage s on row s mod " + w +
        ", or " + std::to_string(2 * plan.workers) + " stages in a V (row r: stages r and " +
        std::to_string(2 * plan.workers - 1) + " - r); move stage " + std::to_string(s) +
        "'s actions to row " + std::to_string(s % plan.workers) + ", or place every stage in "
        "the V");
  }
}

std::string plan_to_csv(const Plan& plan) {
  std::string out;
  for (const auto& list : plan.lists) {
    for (size_t k = 0; k < list.size(); ++k) {
      if (k > 0) out += ',';
      out += std::to_string(list[k].stage) + letter(list[k].op) +
             std::to_string(list[k].microbatch);
    }
    out += '\n';
  }
  return out;
}

Simulation simulate(const Plan& plan, const Costs& costs) {
  check_costs(costs);
  const Split split = check_structure(plan);
  Run r = run(plan, split, costs);
  Simulation sim;
  sim.start = std::move(r.start);
  sim.makespan = r.makespan;
  for (const auto& list : plan.lists) {
    for (const Task& t : list) sim.work += duration(t.op, costs);
  }
  sim.bubble = sim.makespan > 0
                   ? 1 - sim.work / (static_cast<double>(plan.workers) * sim.makespan)
                   : 0;
  // Activations are held from F until the task that frees them: B, or W
  // when split (I still needs them and W too). Counted in list order, the
  // order the worker really frees and allocates in.
  for (const auto& list : plan.lists) {
    int64_t held = 0;
    int64_t peak = 0;
    for (const Task& t : list) {
      if (t.op == Op::F) {
        peak = std::max(peak, ++held);
      } else if (t.op == Op::B || t.op == Op::W) {
        --held;
      }
    }
    sim.peak_in_flight.push_back(peak);
  }
  return sim;
}

std::string render(const Plan& plan) {
  const Simulation sim = simulate(plan, Costs{1, 1, 1, 1});
  const bool virtual_stages = plan.stages > plan.workers;
  auto label = [&](const Task& t) {
    std::string cell = std::string(1, letter(t.op)) + std::to_string(t.microbatch);
    if (virtual_stages) cell += "." + std::to_string(t.stage);
    return cell;
  };
  size_t width = 1 + std::to_string(plan.microbatches - 1).size();
  if (virtual_stages) width += 1 + std::to_string(plan.stages - 1).size();
  const std::string empty_cell(width, '.');
  std::string out;
  for (size_t w = 0; w < plan.lists.size(); ++w) {
    const auto& list = plan.lists[w];
    // A row ends at its worker's last task: no trailing empty cells.
    size_t row_width = 0;
    for (double t : sim.start[w]) row_width = std::max(row_width, static_cast<size_t>(t) + 1);
    std::vector<std::string> cells(row_width, empty_cell);
    for (size_t k = 0; k < list.size(); ++k) {
      std::string cell = label(list[k]);
      cell.resize(width, ' ');
      cells[static_cast<size_t>(sim.start[w][k])] = cell;
    }
    std::string line = "worker " + std::to_string(w) + ":";
    for (const auto& c : cells) line += " " + c;
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

}  // namespace gpipe::detail
