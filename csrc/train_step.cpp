// train_step.cpp — one training step inside the pipeline: the plan's tasks on the workers, the loss, the grads into .grad.
//
// Unlike forward + loss.backward(), no autograd node links the stages: each
// task runs its stage's graph itself on its worker thread, the last stage's
// F runs the loss and its grad right away, and the grads reaching tensors
// outside the cells (parameters) go straight into `.grad`:
//
//   worker of stage s:  F(s,i): receive x -> forward -> send y to s+1
//                       [last stage: loss_i(y, t_i) * rows_i/rows -> dy]
//                       B(s,i): receive dy -> [recompute] -> backward -> send dx to s-1,
//                               parameters' grads into .grad
//                       I(s,i) / W(s,i): B in two halves (split.h)
//
// CUDA deadlock rule (docs/gpu.md): it concerns a Pipe's backward run by an
// autograd device thread (PipeBackward), which must not wait for workers
// whose nested backwards need that very thread. Here the workers drive every
// backward themselves: a worker's backward waits for the device threads to
// run its CUDA nodes, but no device thread ever waits for a worker (no
// PipeBackward is involved), so there is no cycle, the rule does not apply
// and every stage keeps its worker.
#include "engine.h"

#include "check.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/full.h>
#include <ATen/ops/full_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

namespace gpipe::detail {

namespace {

using torch::autograd::Edge;

// Where the step's grads for tensors outside the cells go, one entry per
// outside edge, shared by every worker: a hook-free leaf accumulator that
// one stage's cells reach gets each grad as it arrives (through the entry's
// slot, graph.h), in that stage's fixed order; anything else (a hooked leaf,
// a non-leaf's grad_fn, and in-process a leaf that cells of several stages
// reach: a weight tied across stages) gets the step's sum once at the end,
// as autograd would hand it on. That sum is kept per stage (each stage's
// worker adds its cells' grads in its plan's order) and added in stage
// order, so it does not depend on which worker came first: a seeded step
// gives bitwise the same grads every time.
class Outside {
 public:
  struct Entry {
    Edge edge;
    torch::autograd::AccumulateGrad* accumulate = nullptr;
    GradSlot slot;
    /// Per stage (this engine's): whether its cells reach the edge (as
    /// their forwards find), and the sum of its grads kept for the end.
    std::vector<char> reached;
    std::vector<at::Tensor> sums;
  };

  /// `stages`: this engine's; `tied_apart`: whether a leaf several stages
  /// reach has its grads summed at the end (in-process: the stages' workers
  /// would race; over a group one worker runs a rank's stages in order, and
  /// the grad reducer reads .grad as each stage finishes).
  Outside(size_t stages, bool tied_apart) : stages_(stages), tied_apart_(tied_apart) {}

  /// Notes that (local) stage `stage`'s cell reaches `cut`'s external
  /// edges. Called after each forward, before its outputs go on: every
  /// forward of a micro-batch is noted before any backward of it starts.
  void reach(const Cut& cut, size_t stage) {
    std::lock_guard<std::mutex> hold(mutex_);
    for (const Edge& edge : cut.externals) entry(edge).reached[stage] = 1;
  }

  /// The sinks for `cut`'s external edges, and their entries.
  std::vector<ExternalSink> sinks(const Cut& cut, std::vector<Entry*>& entries) {
    std::lock_guard<std::mutex> hold(mutex_);
    std::vector<ExternalSink> out(cut.externals.size());
    entries.assign(cut.externals.size(), nullptr);
    for (size_t e = 0; e < cut.externals.size(); ++e) {
      Entry& entry = this->entry(cut.externals[e]);
      int stages = 0;
      for (char r : entry.reached) stages += r;
      entries[e] = &entry;
      out[e].wanted = true;
      out[e].accumulate = tied_apart_ && stages > 1 ? nullptr : entry.accumulate;
      out[e].slot = &entry.slot;
    }
    return out;
  }

  /// Adds what (local) stage `stage`'s cell's backward returned (for edges
  /// not accumulated straight into .grad) into that stage's sums.
  static void add(const std::vector<Entry*>& entries, std::vector<at::Tensor>& grads,
                  size_t stage) {
    for (size_t e = 0; e < grads.size(); ++e) {
      if (!grads[e].defined()) continue;
      // Only this stage's worker writes its sum, on its compute stream.
      at::Tensor& sum = entries[e]->sums[stage];
      sum = sum.defined() ? sum + grads[e] : std::move(grads[e]);
    }
  }

  /// The step's sum for `entry` (stage by stage), or undefined when all of
  /// its grads went straight into .grad. Call on the caller's streams once
  /// they wait for every stage.
  static at::Tensor total(Entry& entry) {
    at::Tensor sum;
    for (auto& part : entry.sums) {
      if (!part.defined()) continue;
      // Made on its stage's stream, read on the current one.
      record_on_current_streams({part});
      sum = sum.defined() ? sum + part : part;
      part = at::Tensor();
    }
    return sum;
  }

  const std::vector<Entry*>& entries() const noexcept { return order_; }

  /// The slot of `leaf`'s accumulator, once a cell's backward has reached
  /// it; else null.
  GradSlot* slot_of(const at::Tensor& leaf) {
    const auto node = torch::autograd::impl::try_get_grad_accumulator(leaf);
    if (!node) return nullptr;
    std::lock_guard<std::mutex> hold(mutex_);
    auto it = by_edge_.find(Key(node.get(), 0));
    return it == by_edge_.end() ? nullptr : &it->second->slot;
  }

 private:
  // (under mutex_)
  Entry& entry(const Edge& edge) {
    auto& slot = by_edge_[Key(edge.function.get(), edge.input_nr)];
    if (!slot) {
      slot = std::make_unique<Entry>();
      slot->edge = edge;
      slot->accumulate = plain_accumulator(edge);
      slot->reached.assign(stages_, 0);
      slot->sums.resize(stages_);
      order_.push_back(slot.get());
    }
    return *slot;
  }

  using Key = std::pair<const torch::autograd::Node*, uint32_t>;
  struct Hash {
    size_t operator()(const Key& key) const noexcept {
      return std::hash<const void*>()(key.first) * 31 + key.second;
    }
  };
  size_t stages_;
  bool tied_apart_;
  std::mutex mutex_;
  std::unordered_map<Key, std::unique_ptr<Entry>, Hash> by_edge_;
  std::vector<Entry*> order_;
};

// The micro-batch row counts of a scatter: those of its first cut value
// (all cut values have the same), or empty when nothing is cut.
std::vector<int64_t> rows_of(const Scattered& scattered) {
  for (const auto& cut : scattered.cuts) {
    if (cut.dim) return cut.sizes;
  }
  return {};
}

int64_t total(const std::vector<int64_t>& values) {
  int64_t sum = 0;
  for (int64_t v : values) sum += v;
  return sum;
}

// The in-process check's message where the target's rows differ from the input's.
std::string rows_mismatch(const std::vector<int64_t>& target_rows,
                          const std::vector<int64_t>& rows) {
  return c10::str("train_step's target has ", total(target_rows), " rows along dim 0 (cut into ",
                  listed(target_rows), ") but the input has ", total(rows),
                  " along its batch dim (cut into ", listed(rows),
                  "); the target is cut like the input: give one target row per input row");
}

// Forward tasks only, in the plan's order: eval_step's plan.
Plan forwards_of(Plan plan) {
  for (auto& list : plan.lists) {
    std::erase_if(list, [](const Task& t) { return t.op != Op::F; });
  }
  return plan;
}

}  // namespace

void Engine::set_plan(Plan plan) {
  const int64_t lists = transport_ ? transport_->ranks() : workers();
  const char* per = transport_ ? "rank" : "device";
  GPIPE_CHECK_VALUE(plan.workers == lists, "the schedule has ", plan.workers,
                    " rows but the pipe runs on ", lists, " ", per,
                    "s; give one row of actions per ", per);
  GPIPE_CHECK_VALUE(plan.stages == all_stages_, "the schedule names ", plan.stages,
                    " stages but the pipe has ", all_stages_,
                    " (its balance); give actions for stages 0 to ", all_stages_ - 1);
  GPIPE_CHECK_VALUE(plan.microbatches == chunks_, "the schedule runs ", plan.microbatches,
                    " micro-batches but chunks is ", chunks_, "; pass chunks=",
                    plan.microbatches, " or a schedule for ", chunks_, " micro-batches");
  try {
    require_runnable_placement(plan);
    validate(plan);
  } catch (const std::invalid_argument& e) {
    GPIPE_CHECK_VALUE(false, e.what());
  }
  // The stages were placed when the engine was made (their devices, over a
  // group their ranks): a loop, or a V when built for one (Pipe and
  // DistributedPipe build for the V when the table has it).
  const bool built_v = transport_ ? transport_->v_placed() : !placement_.empty();
  for (int64_t s = 0; s < all_stages_; ++s) {
    const int64_t built = transport_ ? transport_->owner(s) : worker_of(s);
    GPIPE_CHECK_VALUE(plan.worker_of(s) == built, "the schedule runs stage ", s, " on row ",
                      plan.worker_of(s), " but the pipe placed it on ", per, " ", built, " (",
                      built_v ? "a V" : "a loop",
                      "); build the pipe with this schedule, or give a table of its placement");
  }
  plan.kind = PlanKind::Custom;
  plan_kind_ = PlanKind::Custom;
  plan_ = std::move(plan);
}

const Plan& Engine::plan(int64_t microbatches) {
  if (plan_kind_ == PlanKind::Custom) {
    GPIPE_CHECK_VALUE(plan_->microbatches == microbatches, "this batch makes ", microbatches,
                      " micro-batches (fewer rows than chunks) but the pipe's schedule runs ",
                      plan_->microbatches, "; give at least ", plan_->microbatches, " rows");
    return *plan_;
  }
  if (!plan_ || plan_->microbatches != microbatches) {
    try {
      // Over a group the plan is the whole pipeline's: one list per rank.
      const int64_t lists = transport_ ? transport_->ranks() : workers();
      Plan made = make_plan(plan_kind_, lists, virtual_stages_, microbatches);
      validate(made);
      plan_ = std::move(made);
    } catch (const std::invalid_argument& e) {
      GPIPE_CHECK_VALUE(false, e.what());
    }
  }
  return *plan_;
}

at::Tensor Engine::train_step(const Batch& input, const Batch& target, const LossFn& loss_fn,
                              bool training) {
  Call call(*this, "train_step");
  if (!at::GradMode::is_enabled()) {
    const std::string what =
        "train_step was called with grad mode off (torch.no_grad() or inference mode); a "
        "training step needs grads: call it outside no_grad, or use forward for inference";
    if (transport_ && failed_.empty()) {
      StepStart mine;
      mine.error = what;
      start_step(mine, nullptr, /*training_step=*/true);
    }
    throw_value_error(what);
  }
  if (!ties_) return step(input, target, &loss_fn, training, nullptr);
  ties_->begin_step();
  at::Tensor loss;
  try {
    loss = step(input, target, &loss_fn, training, nullptr);
  } catch (...) {
    ties_->restore_grads();
    throw;
  }
  // Every rank got here: the step ran through on all of them.
  try {
    ties_->reduce_grads();
  } catch (const std::exception& e) {
    failed_ = first_line(e.what());
    ties_->restore_grads();
    throw;
  }
  return loss;
}

Batch Engine::eval_step(const Batch& input) {
  Call call(*this, "eval_step");
  std::vector<Batch> outputs;
  step(input, Batch(), nullptr, /*training=*/false, &outputs);
  if (!holds(all_stages_ - 1)) return Batch();
  // step() ordered the caller's current streams after every lane; the
  // outputs, made on the last stage's compute stream, are recorded on the
  // caller's current stream too, so the caching allocator keeps their
  // blocks until the caller's work on them (queued after this returns) is
  // done, wherever the caller frees them.
  for (const auto& part : outputs) record_on_current_streams(part.values);
  return gather(outputs, output_dims_);
}

void Engine::check_agreement(const std::vector<Setting>& settings, const std::string& what) {
  Call call(*this, "check_agreement");
  if (!transport_) return;
  detail::check_agreement(transport_->group(), transport_->wire_device(), settings, what);
}

void Engine::set_ties(std::vector<Tie> ties) {
  Call call(*this, "set_ties");
  if (!transport_ || ties.empty()) return;
  ties_ = std::make_unique<TiedParameters>(std::move(ties), transport_->group(),
                                           transport_->wire_device());
  ties_->broadcast();
}

void Engine::set_tie_replicas(const std::vector<at::Tensor>& replicas) {
  Call call(*this, "set_tie_replicas");
  if (ties_) ties_->set_replicas(replicas);
}

void Engine::abandon_step(const std::string& what, bool training_step) {
  Call call(*this, training_step ? "train_step" : "eval_step");
  if (!transport_ || !failed_.empty()) return;
  StepStart mine;
  mine.error = first_line(what);
  start_step(mine, nullptr, training_step);
}

void Engine::start_step(const StepStart& mine, const std::exception_ptr& own,
                        bool training_step) {
  const char* call = training_step ? "train_step" : "eval_step";
  const auto all =
      exchange_step_start(transport_->group(), transport_->wire_device(), mine, chunks_,
                          transport_->step_timeout());
  std::vector<int64_t> bad;
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].error.empty()) bad.push_back(static_cast<int64_t>(r));
  }
  // The data-parallel replicas run the step together (their grads meet in
  // it): they learn whether any of them stops.
  bool replica_bad = false;
  if (training_step && data_group_ && data_group_->getSize() > 1) {
    const bool gloo = data_group_->getBackendName() == "gloo";
    const c10::Device device = gloo ? c10::Device(c10::kCPU) : stages_.front()->lane().device;
    std::vector<at::Tensor> flag{
        at::full({1}, bad.empty() ? 0 : 1, at::TensorOptions().dtype(at::kLong)).to(device)};
    data_group_->allreduce(flag)->wait();
    replica_bad = flag[0].to(at::kCPU).item<int64_t>() != 0;
  }
  if (!mine.error.empty()) {
    if (own) std::rethrow_exception(own);
    return;  // the caller raises its own error
  }
  if (!bad.empty()) {
    const auto others = static_cast<int64_t>(bad.size()) - 1;
    throw_value_error(c10::str(
        "rank ", bad.front(), "'s ", call, " got bad arguments (",
        all[static_cast<size_t>(bad.front())].error, ")",
        others > 0 ? ", and so did " + count(others, "other rank") : std::string(),
        ", so no rank ran this step and nothing was sent; fix them there, the pipe works on"));
  }
  if (replica_bad) {
    throw_value_error(c10::str(
        "a data-parallel replica's ", call, " got bad arguments (its ranks name them), so no "
        "replica ran this step and nothing was sent; the pipe works on"));
  }
  if (training_step) {
    const auto& input_rows = all[static_cast<size_t>(transport_->owner(0))].input_rows;
    const auto& target_rows =
        all[static_cast<size_t>(transport_->owner(all_stages_ - 1))].target_rows;
    GPIPE_CHECK_VALUE(input_rows.empty() || target_rows.empty() || input_rows == target_rows,
                      rows_mismatch(target_rows, input_rows));
  }
}

std::vector<int64_t> Engine::stage_indices() const {
  std::vector<int64_t> indices;
  for (const auto& stage : stages_) indices.push_back(stage->index());
  return indices;
}

at::Tensor Engine::step(const Batch& input, const Batch& target, const LossFn* loss_fn,
                        bool training, std::vector<Batch>* outputs) {
  if (!failed_.empty()) {
    // Not a bad argument: the pipe's state (RuntimeError, no backtrace).
    throw c10::Error(c10::str("a previous step over this process group failed (", failed_,
                              "), which leaves the group's hand-offs in an unknown state; "
                              "destroy the process group and build the pipe again"),
                     /*backtrace=*/nullptr);
  }
  const int64_t s_count = all_stages_;
  // Over a group, the input lives on stage 0's rank, the target on the last
  // stage's, and every rank runs `chunks` micro-batches. Before anything is
  // sent the ranks exchange their argument errors and rows (start_step): a
  // bad argument on any rank stops every rank cleanly, and the pipe works on.
  const bool first = holds(0);
  const bool last = holds(s_count - 1) && loss_fn != nullptr;
  std::optional<Plan> forwards;
  auto plan_of = [&](int64_t microbatches) -> const Plan& {
    if (loss_fn) return this->plan(microbatches);
    // eval_step: the forwards of the schedule's plan, in its order (a valid
    // plan's forwards alone cannot deadlock: they wait on forwards only).
    forwards = forwards_of(this->plan(microbatches));
    return *forwards;
  };
  Scattered scattered;
  Scattered targets;
  std::vector<int64_t> rows;
  int64_t m = chunks_;
  StepStart mine;
  std::exception_ptr own;
  try {
    if (first) scattered = scatter(input, chunks_, input_dims_);
    if (last) targets = scatter(target, chunks_, BatchDims{0}, "target");
    if (transport_) {
      GPIPE_CHECK_VALUE(!first || static_cast<int64_t>(scattered.microbatches.size()) == chunks_,
                        "the input makes ", scattered.microbatches.size(), " micro-batches but "
                        "every rank of the pipeline runs chunks=", chunks_,
                        "; give at least ", chunks_, " rows");
      GPIPE_CHECK_VALUE(!last || static_cast<int64_t>(targets.microbatches.size()) == chunks_,
                        "the target makes ", targets.microbatches.size(), " micro-batches but "
                        "every rank of the pipeline runs chunks=", chunks_,
                        "; give one target row per input row, at least ", chunks_);
    } else {
      m = static_cast<int64_t>(scattered.microbatches.size());
    }
    const auto target_rows = rows_of(targets);
    rows = first ? rows_of(scattered) : target_rows;
    GPIPE_CHECK_VALUE(rows.empty() || target_rows.empty() || rows == target_rows,
                      rows_mismatch(target_rows, rows));
    GPIPE_CHECK_VALUE(!last || static_cast<int64_t>(targets.microbatches.size()) == m ||
                          target_rows.empty(),
                      "train_step's target makes ", targets.microbatches.size(),
                      " micro-batches but the input ", m, "; give one target row per input row");
    if (first) mine.input_rows = rows_of(scattered);
    if (last) mine.target_rows = target_rows;
  } catch (const std::exception& e) {
    if (!transport_) throw;
    own = std::current_exception();
    mine.error = first_line(e.what());
  }
  const Plan* plan_ptr = nullptr;
  if (transport_) {
    start_step(mine, own, loss_fn != nullptr);
    plan_ptr = &plan_of(chunks_);
    transport_->begin(chunks_, plan_handoffs(*plan_ptr, transport_->rank(), skips_.routes),
                      skips_.routes);
  }
  // Data parallel (reduce.h): from here on, a step that throws still takes
  // part in the replicas' grad exchange, so none of them waits for it.
  GradReducer* const reducer = loss_fn && transport_ ? reducer_.get() : nullptr;
  struct AbortReduce {
    Engine& engine;
    GradReducer* reducer;
    ~AbortReduce() {
      if (!reducer) return;
      reducer->abort();
      if (engine.failed_.empty()) engine.failed_ = "a data-parallel step failed";
    }
  } abort_reduce{*this, reducer};
  if (reducer) reducer->begin(*plan_ptr, transport_->rank(), stage_indices());
  if (!plan_ptr) plan_ptr = &plan_of(m);
  const Plan& plan = *plan_ptr;
  // Small outside edges share capture nodes (graph.h) unless the plan
  // splits backwards in I and W, where a shared node would tie them.
  bool share_captures = true;
  for (const auto& list : plan.lists) {
    for (const auto& task : list) share_captures = share_captures && task.op != Op::I;
  }

  // Micro-batch i's loss counts rows_i / rows of the whole batch's mean.
  std::vector<double> scale(static_cast<size_t>(m), 1.0 / static_cast<double>(m));
  if (!rows.empty() && total(rows) > 0) {
    for (int64_t i = 0; i < m; ++i) {
      scale[static_cast<size_t>(i)] = static_cast<double>(rows[static_cast<size_t>(i)]) /
                                      static_cast<double>(total(rows));
    }
  }

  const int64_t step = tracer_.enabled() ? tracer_.next_step() : 0;
  const CheckpointStops stops = checkpoint_stops(m, training);
  const at::ThreadLocalState forward_state;
  const std::optional<uint64_t> seed = begin_draws(m);

  // As in forward: each micro-batch counts its versions on its own.
  const auto ready = from_current_streams(input).ready;
  std::vector<Payload> sources;
  sources.reserve(static_cast<size_t>(m));
  for (auto& mb : scattered.microbatches) {
    if (m > 1) {
      for (auto& t : mb.values) {
        if (!t.defined()) continue;
        auto own = t.variable_data();
        if (t.requires_grad()) own.requires_grad_(true);
        t = std::move(own);
      }
    }
    sources.push_back(Payload{std::move(mb), ready});
  }
  const auto target_ready = from_current_streams(target).ready;
  // Where the caller's input needs a grad, stage 0 passes one back.
  std::vector<bool> input_wanted(input.size(), false);
  for (size_t v = 0; v < input.size(); ++v) {
    input_wanted[v] = input[v].defined() && input[v].requires_grad();
  }

  std::vector<std::vector<Cell>> cells(stages_.size(), std::vector<Cell>(static_cast<size_t>(m)));
  std::vector<Batch> output_grads(static_cast<size_t>(m));
  std::vector<at::Tensor> losses(static_cast<size_t>(m));
  std::vector<Payload> input_grads(static_cast<size_t>(m));
  Outside outside(stages_.size(), /*tied_apart=*/!transport_);
  // The reducer reads tied leaves' grads after every stage's writes (graph.h).
  struct UnsetSlots {
    GradReducer* reducer;
    ~UnsetSlots() {
      if (reducer) reducer->set_slots(nullptr);
    }
  } unset_slots{reducer};
  if (reducer) {
    reducer->set_slots([&outside](const at::Tensor& leaf) { return outside.slot_of(leaf); });
  }
  // In-process: every stage here, mailboxes between them. Over a group:
  // this rank's stages, the process group between ranks.
  // Over a group the hand-offs with other ranks are traced (Send, Receive).
  std::optional<Mailboxes> mailboxes;
  std::optional<TracedTransport> remote;
  if (transport_) {
    remote.emplace(*transport_, skips_, tracer_, step);
  } else {
    mailboxes.emplace(s_count, m, skips_.size());
  }
  Transport& mail = transport_ ? static_cast<Transport&>(*remote) : *mailboxes;
  if (outputs) outputs->assign(static_cast<size_t>(m), Batch());

  const TaskFn task = [&](const Task& t, const char*& phase) {
    const int64_t s = t.stage;
    const int64_t i = t.microbatch;
    Stage& stage = *stages_[local(s)];
    const Lane& lane = stage.lane();
    auto guard = on_compute_stream(stage);
    Cell& cell = cells[local(s)][static_cast<size_t>(i)];
    if (t.op == Op::F) {
      std::optional<Payload> in;
      if (s == 0) {
        in = std::move(sources[static_cast<size_t>(i)]);
      } else {
        in = mail.receive({s, Flow::Activation, i});
      }
      if (!in) return;  // cancelled
      Batch x = receive_traced(std::move(*in), lane, tracer_, step, s, i);
      if (!receive_skips(mail, Flow::Skip, skips_.arriving[static_cast<size_t>(s)], s, i, x, lane,
                         tracer_, step)) {
        return;  // cancelled
      }
      Span span(tracer_, step, s, i, TracePhase::Forward, lane.compute);
      Batch y = stage.forward(cell, x, i < stops.per_stage[static_cast<size_t>(s)], stops.any,
                              CellDraws{i, seed}, share_captures);
      span.finish();
      if (loss_fn) outside.reach(cell.cut, local(s));
      if (s + 1 < s_count) {
        // Skips first: the popping stage gets them before micro-batch i.
        auto ready = mark(lane.compute);
        send_skips(mail, Flow::Skip, skips_.leaving[static_cast<size_t>(s)], skips_, i, y, ready);
        mail.send({s + 1, Flow::Activation, i}, Payload{std::move(y), std::move(ready)});
        return;
      }
      if (!loss_fn) {
        // Kept as made on the compute stream (this thread's current one);
        // eval_step hands them over on the caller's streams (streams.h).
        (*outputs)[static_cast<size_t>(i)] = std::move(y);
        return;
      }
      phase = "loss";
      Span loss_span(tracer_, step, s, i, TracePhase::Loss, lane.compute);
      Batch target_i =
          receive(Payload{std::move(targets.microbatches[static_cast<size_t>(i)]), target_ready},
                  lane);
      at::Tensor loss = (*loss_fn)(y, target_i);
      TORCH_CHECK(loss.defined() && loss.numel() == 1, "loss_fn returned ",
                  loss.defined() ? "a tensor of shape " + listed(loss.sizes().vec())
                                 : std::string("an undefined tensor"),
                  " for micro-batch ", i,
                  "; it must return the micro-batch's loss as one number, mean-reduced over its "
                  "rows (e.g. ", loss_example_, ")");
      TORCH_CHECK(loss.requires_grad(), "the loss of micro-batch ", i,
                  " does not require grad: nothing before it needs a grad (every parameter "
                  "frozen?), or loss_fn detached the output");
      losses[static_cast<size_t>(i)] = loss.detach();
      // The loss's own graph runs backward here, down to the stage's
      // outputs (leaves: their grads are the last stage's B input) and
      // whatever else the loss reached (the target, a loss's parameters).
      torch::autograd::Engine::get_default_engine().execute(
          {torch::autograd::impl::gradient_edge(loss)},
          {at::full_like(loss, scale[static_cast<size_t>(i)])}, /*keep_graph=*/false,
          /*create_graph=*/false, /*accumulate_grad=*/true, /*outputs=*/{});
      Batch dy;
      dy.atomic = y.atomic;
      for (const auto& v : y.values) dy.values.push_back(v.defined() ? v.grad() : at::Tensor());
      output_grads[static_cast<size_t>(i)] = std::move(dy);
      loss_span.finish();
      return;
    }
    std::vector<Outside::Entry*> entries;
    std::vector<at::Tensor> external_grads;
    if (t.op == Op::W) {
      auto sinks = outside.sinks(cell.cut, entries);
      Span span(tracer_, step, s, i, TracePhase::WeightGrad, lane.compute);
      stage.backward_weight(cell, sinks, external_grads);
      Outside::add(entries, external_grads, local(s));
      span.finish();
      return;
    }
    // B or I.
    Batch dy;
    if (s + 1 == s_count) {
      dy = std::move(output_grads[static_cast<size_t>(i)]);
    } else {
      auto in = mail.receive({s, Flow::Grad, i});
      if (!in) return;  // cancelled
      dy = receive_traced(std::move(*in), lane, tracer_, step, s, i);
    }
    if (!receive_skips(mail, Flow::SkipGrad, skips_.leaving[static_cast<size_t>(s)], s, i, dy, lane,
                       tracer_, step)) {
      return;  // cancelled
    }
    const char* name = phase;
    if (cell.checkpointed) {
      phase = "recompute";
      Span span(tracer_, step, s, i, TracePhase::Recompute, lane.compute);
      stage.recompute(cell, forward_state);
      span.finish();
      phase = name;
    }
    const size_t values = cell.input_sinks.size();
    std::vector<bool> wanted(values, true);
    if (s == 0) {
      for (size_t v = 0; v < values; ++v) wanted[v] = v < input_wanted.size() && input_wanted[v];
    }
    auto sinks = outside.sinks(cell.cut, entries);
    Batch dx;
    {
      Span span(tracer_, step, s, i,
                t.op == Op::B ? TracePhase::Backward : TracePhase::InputGrad, lane.compute);
      dx = t.op == Op::B
               ? stage.backward(cell, dy, /*keep_graph=*/false, wanted, sinks, external_grads)
               : stage.backward_input(cell, dy, wanted, sinks, external_grads);
      Outside::add(entries, external_grads, local(s));
      span.finish();
    }
    auto ready = mark(lane.compute);
    // Skip grads first: the stashing stage gets them before micro-batch i.
    send_skips(mail, Flow::SkipGrad, skips_.arriving[static_cast<size_t>(s)], skips_, i, dx, ready);
    Payload out{std::move(dx), std::move(ready)};
    if (s > 0) {
      mail.send({s - 1, Flow::Grad, i}, std::move(out));
    } else {
      input_grads[static_cast<size_t>(i)] = std::move(out);
    }
  };

  // Data parallel: after each task the reducer sees what a forward reached
  // and starts a stage's buckets once its grads are final.
  const TaskFn reducing = [&](const Task& t, const char*& phase) {
    task(t, phase);
    if (mail.cancelled()) return;  // the step fails: nothing is final
    Stage& stage = *stages_[local(t.stage)];
    auto guard = on_compute_stream(stage);
    const Cell& cell = cells[local(t.stage)][static_cast<size_t>(t.microbatch)];
    reducer->task_done(t, t.op == Op::F ? &cell.cut : nullptr);
  };

  const auto lanes = this->lanes();
  wait_for_current_streams(lanes);
  // A failure over a group tells the other ranks before anything else.
  auto fail_group = [&](const std::string& what) {
    if (!transport_) return;
    failed_ = first_line(what);
    transport_->fail(what);
  };
  try {
    if (transport_) {
      executor_.run_plan(plan, reducer ? reducing : task, mail, forward_state,
                         {transport_->rank()});
      transport_->finish();
    } else {
      executor_.run_plan(plan, task, mail, forward_state);
    }
  } catch (const CellError& e) {
    fail_group(e.what());
    current_streams_wait_for(lanes);
    if (error_hook_) error_hook_(e);
    throw;
  } catch (const std::exception& e) {
    fail_group(e.what());
    current_streams_wait_for(lanes);
    throw;
  } catch (...) {
    fail_group("unknown error");
    current_streams_wait_for(lanes);
    throw;
  }
  current_streams_wait_for(lanes);
  if (!loss_fn) return at::Tensor();

  // What leaves the pipeline at its ends goes on as autograd would: the
  // input's grad into the caller's input (its .grad, or its graph), the
  // sums for hooked leaves and non-leaf outside tensors to their nodes.
  torch::autograd::edge_list roots;
  std::vector<at::Tensor> root_grads;
  bool any_input_grad = false;
  for (bool w : input_wanted) any_input_grad = any_input_grad || w;
  if (any_input_grad) {
    std::vector<Batch> parts;
    parts.reserve(input_grads.size());
    for (auto& p : input_grads) parts.push_back(settle(std::move(p)));
    for (size_t v = 0; v < input.size(); ++v) {
      if (!input_wanted[v]) continue;
      std::vector<at::Tensor> per_microbatch;
      for (const auto& p : parts) per_microbatch.push_back(v < p.size() ? p[v] : at::Tensor());
      at::Tensor grad = join_grads(per_microbatch, scattered.cuts[v]);
      if (!grad.defined()) continue;
      if (grad.device() != input[v].device()) grad = grad.to(input[v].device());
      roots.push_back(torch::autograd::impl::gradient_edge(input[v]));
      root_grads.push_back(std::move(grad));
    }
  }
  for (auto* entry : outside.entries()) {
    at::Tensor sum = Outside::total(*entry);
    if (!sum.defined()) continue;
    roots.push_back(entry->edge);
    root_grads.push_back(std::move(sum));
  }
  if (!roots.empty()) {
    torch::autograd::Engine::get_default_engine().execute(roots, root_grads, /*keep_graph=*/false,
                                                          /*create_graph=*/false,
                                                          /*accumulate_grad=*/true, {});
  }

  if (reducer) {
    try {
      reducer->finish();
    } catch (const std::exception& e) {
      failed_ = first_line(e.what());
      throw;
    }
    abort_reduce.reducer = nullptr;
  }

  at::NoGradGuard plain;
  at::Tensor loss;
  if (!last) return loss;
  for (int64_t i = 0; i < m; ++i) {
    const at::Tensor term = losses[static_cast<size_t>(i)] * scale[static_cast<size_t>(i)];
    loss = loss.defined() ? loss + term : term;
  }
  return loss;
}

}  // namespace gpipe::detail
