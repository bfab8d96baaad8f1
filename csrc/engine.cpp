// engine.cpp — the engine: construction, the forward half on the workers and its autograd wiring (the backward half: engine_backward.cpp).
#include "engine.h"

#include "check.h"
#include "pipe_backward.h"
#include "rng.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>

namespace gpipe::detail {

std::optional<c10::StreamGuard> on_compute_stream(const Stage& stage) {
  if (stage.device().is_cpu()) return std::nullopt;
  return std::optional<c10::StreamGuard>(std::in_place, stage.lane().compute);
}

int64_t checkpointed_microbatches(Checkpoint mode, int64_t microbatches) {
  switch (mode) {
    case Checkpoint::Always:
      return microbatches;
    case Checkpoint::ExceptLast:
      return microbatches - 1;
    case Checkpoint::Never:
      return 0;
  }
  return 0;
}

Batch receive_traced(Payload in, const Lane& lane, Tracer& tracer, int64_t step, int64_t stage,
                     int64_t microbatch) {
  bool crosses = false;
  if (tracer.enabled()) {
    for (const auto& t : in.batch.values) crosses |= t.defined() && t.device() != lane.device;
  }
  if (!crosses) return receive(std::move(in), lane);
  Span span(tracer, step, stage, microbatch, TracePhase::Copy);
  Batch out = receive(std::move(in), lane, &span);
  span.finish();
  return out;
}

Skips::Skips(std::vector<SkipRoute> all, int64_t stages)
    : routes(std::move(all)),
      arriving(static_cast<size_t>(stages)),
      leaving(static_cast<size_t>(stages)) {
  for (size_t r = 0; r < routes.size(); ++r) {
    const auto& route = routes[r];
    GPIPE_CHECK_VALUE(0 <= route.from && route.from < route.to && route.to < stages,
                      "skip route ", r, " runs from stage ", route.from, " to stage ", route.to,
                      " in a pipeline of ", stages, " stages; a skip goes from a stage to a later "
                      "one (one stashed and popped in the same stage is no route)");
    leaving[static_cast<size_t>(route.from)].push_back(static_cast<int64_t>(r));
    arriving[static_cast<size_t>(route.to)].push_back(static_cast<int64_t>(r));
  }
}

bool receive_skips(Transport& transport, Flow flow, const std::vector<int64_t>& routes,
                   int64_t stage, int64_t i, Batch& batch, const Lane& lane, Tracer& tracer,
                   int64_t step) {
  for (int64_t r : routes) {
    auto in = transport.receive({stage, flow, i, r});
    if (!in) return false;
    Batch skip = receive_traced(std::move(*in), lane, tracer, step, stage, i);
    TORCH_INTERNAL_ASSERT(skip.size() == 1);
    batch.values.push_back(std::move(skip[0]));
  }
  return true;
}

void send_skips(Transport& transport, Flow flow, const std::vector<int64_t>& routes,
                const Skips& skips, int64_t i, Batch& batch,
                const std::vector<std::shared_ptr<c10::Event>>& ready) {
  TORCH_CHECK(batch.size() >= routes.size(), "a stage returned ", batch.size(),
              " values but stashes ", routes.size(), " skips for later stages");
  const size_t first = batch.size() - routes.size();
  for (size_t k = 0; k < routes.size(); ++k) {
    const auto& route = skips.routes[static_cast<size_t>(routes[k])];
    const int64_t to = flow == Flow::Skip ? route.to : route.from;
    transport.send({to, flow, i, routes[k]},
                   Payload{Batch(std::move(batch.values[first + k])), ready});
  }
  batch.values.resize(first);
}

int64_t TracedTransport::sender(const Address& a) const {
  switch (a.flow) {
    case Flow::Activation: return a.stage - 1;
    case Flow::Grad: return a.stage + 1;
    case Flow::Skip: return skips_.routes[static_cast<size_t>(a.route)].from;
    case Flow::SkipGrad: return skips_.routes[static_cast<size_t>(a.route)].to;
  }
  return -1;
}

void TracedTransport::send(const Address& to, Payload payload) {
  if (!tracer_.enabled() || group_.owner(to.stage) == group_.rank()) {
    group_.send(to, std::move(payload));
    return;
  }
  const auto start = Tracer::Clock::now();
  group_.send(to, std::move(payload));
  tracer_.record(step_, sender(to), to.microbatch, TracePhase::Send, start, Tracer::Clock::now(),
                 static_cast<int32_t>(to.stage));
}

std::optional<Payload> TracedTransport::receive(const Address& at) {
  if (!tracer_.enabled() || group_.source(at) == group_.rank()) return group_.receive(at);
  const auto start = Tracer::Clock::now();
  auto in = group_.receive(at);
  // A cancelled wait is no hand-off.
  if (in) {
    tracer_.record(step_, at.stage, at.microbatch, TracePhase::Receive, start,
                   Tracer::Clock::now(), static_cast<int32_t>(sender(at)));
  }
  return in;
}

PlanKind plan_kind(gpipe::Schedule schedule) {
  switch (schedule) {
    case gpipe::Schedule::GPipe:
      return PlanKind::GPipe;
    case gpipe::Schedule::OneFOneB:
      return PlanKind::OneFOneB;
    case gpipe::Schedule::Interleaved1F1B:
      return PlanKind::Interleaved1F1B;
    case gpipe::Schedule::ZBH1:
      return PlanKind::ZBH1;
    case gpipe::Schedule::ZBV:
      return PlanKind::ZBV;
  }
  return PlanKind::GPipe;
}

Engine::CheckpointStops Engine::checkpoint_stops(int64_t microbatches, bool training) const {
  CheckpointStops stops;
  stops.per_stage.assign(static_cast<size_t>(all_stages_), 0);
  if (!training) return stops;
  for (size_t s = 0; s < stops.per_stage.size(); ++s) {
    stops.per_stage[s] = checkpointed_microbatches(
        stage_checkpoints_.empty() ? checkpoint_ : stage_checkpoints_[s], microbatches);
    stops.any = stops.any || stops.per_stage[s] > 0;
  }
  return stops;
}

void Engine::set_stage_checkpoints(std::vector<Checkpoint> modes) {
  GPIPE_CHECK_VALUE(static_cast<int64_t>(modes.size()) == all_stages_, "checkpoint has ",
                    modes.size(), " modes for ", all_stages_,
                    " stages; give one mode, or one per stage");
  stage_checkpoints_ = std::move(modes);
}

std::optional<Plan> schedule_table(const std::string& csv, int64_t& virtual_stages) {
  if (csv.empty()) return std::nullopt;
  Plan plan;
  try {
    plan = plan_from_csv(csv);
    require_runnable_placement(plan);
  } catch (const std::invalid_argument& e) {
    GPIPE_CHECK_VALUE(false, e.what());
  }
  const int64_t table = plan.stages / plan.workers;
  GPIPE_CHECK_VALUE(virtual_stages == 1 || virtual_stages == table, "virtual_stages is ",
                    virtual_stages, " but the schedule's table runs ", table,
                    " stages per row (", plan.stages, " stages in ", plan.workers,
                    " rows); leave virtual_stages at 1");
  virtual_stages = table;
  return plan;
}

StageLayout stage_layout(const std::string& csv, gpipe::Schedule schedule,
                         int64_t virtual_stages, const char* per) {
  StageLayout layout;
  layout.virtual_stages = virtual_stages;
  layout.table = schedule_table(csv, layout.virtual_stages);
  int64_t& v = layout.virtual_stages;
  layout.v_shape = layout.table ? v_placed(*layout.table) : schedule == gpipe::Schedule::ZBV;
  if (layout.v_shape) {
    GPIPE_CHECK_VALUE(v == 1 || v == 2, "virtual_stages is ", v, " but schedule zb_v runs two "
                      "stages per ", per, "; leave virtual_stages at 1 or pass 2");
    v = 2;
  }
  GPIPE_CHECK_VALUE(v == 1 || layout.table || layout.v_shape ||
                        schedule == gpipe::Schedule::Interleaved1F1B,
                    "virtual_stages is ", v, " but schedule ", schedule, " runs one stage per ",
                    per, "; use Schedule::Interleaved1F1B, or virtual_stages 1");
  // A table replaces the named schedule (set_plan); the engine is built for
  // its placement (a V as ZB-V's).
  layout.kind = layout.table ? (layout.v_shape ? PlanKind::ZBV : PlanKind::Custom)
                             : plan_kind(schedule);
  return layout;
}

std::vector<int> intra_op_split(const std::vector<c10::Device>& devices, int64_t option,
                                int available) {
  GPIPE_CHECK_VALUE(option >= -1, "intra_op_threads is ", option,
              "; pass 0 to split the cores between the CPU stages (the default), a positive "
              "count of threads per CPU stage, or -1 to leave torch's setting alone");
  std::vector<int> threads(devices.size(), 0);
  if (option == -1) return threads;
  int64_t cpu_stages = 0;
  for (const auto& d : devices) cpu_stages += d.is_cpu() ? 1 : 0;
  int64_t k = 0;  // CPU stages seen so far
  for (size_t j = 0; j < devices.size(); ++j) {
    if (!devices[j].is_cpu()) continue;
    if (option > 0) {
      threads[j] = static_cast<int>(option);
    } else {
      const int64_t share = available / cpu_stages;
      const int64_t extra = k < available % cpu_stages ? 1 : 0;
      threads[j] = static_cast<int>(std::max<int64_t>(1, share + extra));
    }
    ++k;
  }
  return threads;
}

namespace {

// The first `workers` of `devices`: one per worker (stage s < workers runs
// on worker s, on devices[s], in a loop or a V placement alike).
std::vector<c10::Device> worker_devices(const std::vector<c10::Device>& devices, size_t stages,
                                        int64_t virtual_stages) {
  TORCH_INTERNAL_ASSERT(virtual_stages >= 1 && stages % static_cast<size_t>(virtual_stages) == 0);
  const size_t workers = stages / static_cast<size_t>(virtual_stages);
  TORCH_INTERNAL_ASSERT(devices.size() >= workers);
  return std::vector<c10::Device>(devices.begin(),
                                  devices.begin() + static_cast<std::ptrdiff_t>(workers));
}

}  // namespace

Engine::Engine(std::vector<std::unique_ptr<Layers>> layers, const std::vector<c10::Device>& devices,
               int64_t chunks, Checkpoint checkpoint, int64_t intra_op_threads,
               int64_t virtual_stages, PlanKind plan,
               Groups groups)
    : all_stages_(static_cast<int64_t>(layers.size())),
      intra_op_threads_(intra_op_split(worker_devices(devices, layers.size(), virtual_stages),
                                       intra_op_threads, at::get_num_threads())),
      executor_(static_cast<int64_t>(intra_op_threads_.size()), intra_op_threads_),
      chunks_(chunks),
      checkpoint_(checkpoint),
      virtual_stages_(virtual_stages),
      plan_kind_(plan) {
  TORCH_INTERNAL_ASSERT(devices.size() >= layers.size());
  if (groups.pipeline) {
    TORCH_CHECK(static_cast<int64_t>(layers.size()) == virtual_stages, "gpipe: a rank holds ",
                virtual_stages, " stages (virtual_stages) but got ", layers.size());
    const int64_t ranks = groups.pipeline->getSize();
    all_stages_ = virtual_stages * ranks;
    // ZB-V's V over the ranks: rank r runs stages r and 2R-1-r (its one
    // worker runs both; the transport knows where every stage lives).
    GPIPE_CHECK_VALUE(plan != PlanKind::ZBV || virtual_stages == 2, "schedule zb_v runs two "
                      "stages per rank in a V, but virtual_stages is ", virtual_stages,
                      "; pass virtual_stages=2 (balance with 2 entries per rank)");
    // Received tensors land where the backend moves them: the host for
    // Gloo, this rank's device otherwise (NCCL).
    const bool gloo = groups.pipeline->getBackendName() == "gloo";
    transport_ = std::make_unique<ProcessGroupTransport>(
        groups.pipeline, groups.reverse, all_stages_, gloo ? c10::Device(c10::kCPU) : devices[0],
        plan == PlanKind::ZBV ? v_placement(ranks) : std::vector<int64_t>{});
  }
  data_group_ = std::move(groups.data);
  if (data_group_) {
    // The reducer follows one list in order: one worker per rank.
    GPIPE_CHECK_VALUE(transport_, "a data-parallel group needs a pipeline group (one rank per "
                      "list of stages); pass the pipeline's group too");
    if (data_group_->getSize() > 1) {
      // NCCL reduces device tensors only; Gloo's status lives on the host.
      const bool nccl =
          data_group_->getBackendType() == c10d::ProcessGroup::BackendType::NCCL;
      reducer_ = std::make_unique<GradReducer>(data_group_, nccl ? devices[0] : c10::Device(c10::kCPU));
    }
  }
  // Stages are named by their index in the whole pipeline.
  const auto indices = transport_ ? transport_->stages_of(transport_->rank())
                                  : std::vector<int64_t>{};
  for (size_t j = 0; j < layers.size(); ++j) {
    const auto index = transport_ ? indices[j] : static_cast<int64_t>(j);
    stages_.push_back(std::make_unique<Stage>(index, std::move(layers[j]), devices[j]));
  }
  skips_ = Skips({}, stages());
  // Which worker runs each stage: a loop (s mod W) but for ZB-V's V.
  if (plan == PlanKind::ZBV && !transport_) {
    GPIPE_CHECK_VALUE(all_stages_ == 2 * workers(), "schedule zb_v runs two stages per device "
                      "in a V, but got ", all_stages_, " stages on ", workers(),
                      " devices; pass virtual_stages=2 (balance with 2 entries per device)");
    placement_ = v_placement(workers());
  }
  // The RNG rule (rng.h): a default generator that stages on two or more
  // workers draw from is shared; there, cells get streams of their own.
  // (Over a process group one worker runs all of this rank's stages.)
  std::map<const void*, std::set<int64_t>> drawn_by;
  for (size_t j = 0; j < stages_.size(); ++j) {
    for (const auto& g : generators_for(stages_[j]->device())) {
      drawn_by[g.unsafeGetGeneratorImpl()].insert(worker_of(static_cast<int64_t>(j)));
    }
  }
  for (auto& stage : stages_) {
    std::vector<bool> shared;
    for (const auto& g : generators_for(stage->device())) {
      shared.push_back(drawn_by[g.unsafeGetGeneratorImpl()].size() > 1);
      shared_generators_ = shared_generators_ || shared.back();
    }
    stage->set_shared_generators(std::move(shared));
  }
}

std::optional<uint64_t> Engine::begin_draws(int64_t microbatches) {
  for (auto& stage : stages_) stage->begin_step();
  // One micro-batch: the cells run one after the other, drawing in the
  // plain model's order from the live generators.
  if (microbatches <= 1 || !shared_generators_) return std::nullopt;
  return draw_step_seed();
}

void Engine::set_bucket_cap(int64_t bytes) {
  if (reducer_) reducer_->set_bucket_cap(bytes);
}

void Engine::set_step_timeout(std::chrono::milliseconds timeout) {
  if (transport_) transport_->set_step_timeout(timeout);
}

std::vector<GradReducer::Launch> Engine::grad_reduce_launches() const {
  return reducer_ ? reducer_->launches() : std::vector<GradReducer::Launch>{};
}

void Engine::set_batch_dims(BatchDims input, BatchDims output) {
  GPIPE_CHECK_VALUE(!input.empty(), "batch_dim is empty; give one entry for all input values "
                    "(0 by default) or one per value");
  if (output.empty()) {
    std::optional<int64_t> dim = 0;
    for (const auto& d : input) {
      if (d) {
        dim = d;
        break;
      }
    }
    output = {dim};
  }
  input_dims_ = std::move(input);
  output_dims_ = std::move(output);
}

std::vector<const Lane*> Engine::lanes() const {
  std::vector<const Lane*> lanes;
  lanes.reserve(stages_.size());
  for (const auto& s : stages_) lanes.push_back(&s->lane());
  return lanes;
}

Engine::Call::Call(Engine& engine, const char* what) : engine_(engine) {
  const int64_t outer = Executor::current_stage();
  // A forward or train_step from inside a cell is a Pipe within a Pipe's
  // layer. (A backward may legitimately run inside a cell: a stage's nested
  // backward on an autograd device thread may pick up another Pipe's
  // PipeBackward.)
  TORCH_CHECK(std::strcmp(what, "backward") == 0 || outer < 0, "gpipe::Pipe ", what,
              " was called from inside a layer of a Pipe (stage ", outer,
              " of the Pipe running it): a Pipe cannot run within a Pipe's stage; ",
              "call the inner model directly there, or flatten both into one Sequential");
  TORCH_CHECK(engine.owner_.load() != std::this_thread::get_id(), "gpipe::Pipe ", what,
              " was called on the thread already running this Pipe's forward or backward "
              "(a layer calling its own Pipe, or, on an accelerator, one backward reaching two "
              "outputs of the same Pipe at once); a Pipe runs one call at a time");
  // Another thread's forward or backward on this Pipe finishes first: the
  // stages, their workers and their learned state serve one call at a time.
  engine.busy_.lock();
  engine.owner_.store(std::this_thread::get_id());
}

Engine::Call::~Call() {
  engine_.owner_.store(std::thread::id());
  engine_.busy_.unlock();
}

std::vector<Payload> Engine::execute(const Schedule& schedule, std::vector<Payload> sources,
                                     const CellFn& cell, const at::ThreadLocalState& state,
                                     const std::vector<bool>& inline_stages) {
  try {
    return executor_.run(schedule, std::move(sources), cell, state, inline_stages, placement_);
  } catch (const CellError& e) {
    if (error_hook_) error_hook_(e);
    throw;
  }
}

Batch Engine::forward(const Batch& input, bool training) {
  Call call(*this, "forward");
  GPIPE_CHECK_VALUE(!transport_, "a pipeline over a process group runs whole steps on every "
                    "rank: call train_step or eval_step");
  Scattered scattered = scatter(input, chunks_, input_dims_);
  std::vector<Batch>& microbatches = scattered.microbatches;
  const auto m = static_cast<int64_t>(microbatches.size());
  const int64_t k = stages();

  // Under grad mode every cell builds its graph: only the graph knows
  // which outputs need grad and which outside tensors (parameters, tied
  // weights, closures) the stages reach. Without grad mode nothing is kept
  // (pipelined inference).
  const bool graph = at::GradMode::is_enabled();

  auto run = std::make_shared<PipeRun>();
  run->engine = shared_from_this();
  run->microbatches = m;
  run->cells.assign(static_cast<size_t>(k), std::vector<Cell>(static_cast<size_t>(m)));
  run->input_cuts = std::move(scattered.cuts);
  for (const auto& t : input.values) {
    run->input_devices.push_back(t.defined() ? t.device() : c10::Device(c10::kCPU));
  }
  run->forward_state.emplace();
  const int64_t step = tracer_.enabled() ? tracer_.next_step() : 0;
  run->step = step;
  const CheckpointStops stops = checkpoint_stops(m, graph && training);
  const std::optional<uint64_t> seed = begin_draws(m);

  // The input was produced on the caller's current streams: every
  // micro-batch waits for that work.
  const auto ready = from_current_streams(input).ready;
  std::vector<Payload> sources;
  sources.reserve(microbatches.size());
  for (auto& mb : microbatches) sources.push_back(Payload{std::move(mb), ready});

  // The micro-batches are views of the caller's tensors and would share
  // their version counters: a layer working in place on one micro-batch
  // (also behind layers that pass their input on) would then spoil what
  // another saved for backward. Each counts on its own, as the whole batch
  // does in the plain model; the caller's tensors are checked once, before
  // the backward (Engine::backward).
  if (m > 1) {
    for (auto& p : sources) {
      for (auto& t : p.batch.values) {
        if (!t.defined()) continue;
        auto own = t.variable_data();
        if (t.requires_grad()) own.requires_grad_(true);
        t = std::move(own);
      }
    }
  }

  PipeRun& r = *run;
  // Skips go straight from the stashing stage to the popping one. A stage
  // stashes for micro-batch i before it hands i on, so by the time i
  // reaches the popping stage its skips are there: no receive here waits.
  Mailboxes skip_mail(k, m, skips_.size());
  const CellFn cell = [this, &r, &skip_mail, &stops, step, seed](int64_t j, const Action& action,
                                                                Payload in,
                                                                const char*& /*phase*/) {
    Stage& stage = *stages_[static_cast<size_t>(j)];
    auto guard = on_compute_stream(stage);
    const int64_t i = action.microbatch;
    Batch x = receive_traced(std::move(in), stage.lane(), tracer_, step, j, i);
    const auto& arriving = skips_.arriving[static_cast<size_t>(j)];
    if (!arriving.empty()) {
      const bool received = receive_skips(skip_mail, Flow::Skip, arriving, j, i, x, stage.lane(),
                                          tracer_, step);
      TORCH_INTERNAL_ASSERT(received);
    }
    Span span(tracer_, step, j, i, TracePhase::Forward, stage.lane().compute);
    Batch y = stage.forward(r.cells[static_cast<size_t>(j)][static_cast<size_t>(i)], x,
                            i < stops.per_stage[static_cast<size_t>(j)], stops.any,
                            CellDraws{i, seed}, /*share_captures=*/true);
    span.finish();
    auto ready = mark(stage.lane().compute);
    const auto& leaving = skips_.leaving[static_cast<size_t>(j)];
    if (!leaving.empty()) send_skips(skip_mail, Flow::Skip, leaving, skips_, i, y, ready);
    return Payload{std::move(y), std::move(ready)};
  };
  // The one capture of the caller's state serves the forward cells and,
  // later, the recomputes. The stages start after the caller's queued work
  // (an optimizer step may just have written the parameters), and the
  // caller's streams go on after the stages' (see streams.h).
  const auto lanes = this->lanes();
  wait_for_current_streams(lanes);
  std::vector<Payload> sinks;
  try {
    sinks = execute(gpipe_forward(k, m), std::move(sources), cell, *run->forward_state, {});
  } catch (...) {
    current_streams_wait_for(lanes);
    throw;
  }
  current_streams_wait_for(lanes);

  std::vector<Batch> outputs;
  outputs.reserve(sinks.size());
  at::NoGradGuard plain;  // gathering is not part of any graph
  for (auto& p : sinks) outputs.push_back(settle(std::move(p)));
  Batch out = gather(outputs, output_dims_, &run->output_cuts);
  // An output value needs grad where the plain model's would: where the
  // last stage's graph says so for some micro-batch it was joined from (a
  // value not joined is micro-batch 0's).
  std::vector<bool> output_requires_grad(out.size(), false);
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (size_t v = 0; v < out.size(); ++v) {
      const auto& t = outputs[i][v];
      const bool joined = run->output_cuts[v].dim.has_value() || i == 0;
      if (joined && t.defined() && t.requires_grad()) output_requires_grad[v] = true;
    }
  }
  for (auto& t : out.values) {
    if (t.defined()) t = t.detach();
  }
  bool any = false;
  for (bool f : output_requires_grad) any = any || f;
  if (!graph || !any) return out;
  if (m > 1) run->input_watch.watch(input);

  // Wire the outputs to one PipeBackward node whose edges lead to the inputs
  // and to every outside tensor some cell reached, in stage and micro-batch
  // order. What no output depends on gets no edge, as in the plain model's
  // graph, so autograd neither runs the backward for it nor waits for it:
  // grads reach stage j only when every later stage's graphs reach their
  // inputs.
  // A stage's grads come back from the next stage (when its graphs reach
  // its main input) and along the skips it stashed (when the popping
  // stage's graphs reach the skip).
  run->reaches_input.assign(static_cast<size_t>(k), false);
  std::vector<bool> reaches_main(static_cast<size_t>(k), false);
  std::vector<bool> reaches_skip(static_cast<size_t>(skips_.size()), false);
  for (int64_t j = 0; j < k; ++j) {
    const auto& arriving = skips_.arriving[static_cast<size_t>(j)];
    for (const auto& c : run->cells[static_cast<size_t>(j)]) {
      if (c.cut.reached.size() < arriving.size()) continue;
      const size_t main = c.cut.reached.size() - arriving.size();
      for (size_t v = 0; v < c.cut.reached.size(); ++v) {
        if (!c.cut.reached[v]) continue;
        run->reaches_input[static_cast<size_t>(j)] = true;
        if (v < main) {
          reaches_main[static_cast<size_t>(j)] = true;
        } else {
          reaches_skip[static_cast<size_t>(arriving[v - main])] = true;
        }
      }
    }
  }
  std::vector<bool> connected(static_cast<size_t>(k), true);
  for (int64_t j = k - 2; j >= 0; --j) {
    bool linked = connected[static_cast<size_t>(j + 1)] && reaches_main[static_cast<size_t>(j + 1)];
    for (int64_t route : skips_.leaving[static_cast<size_t>(j)]) {
      const auto to = static_cast<size_t>(skips_.routes[static_cast<size_t>(route)].to);
      linked = linked || (connected[to] && reaches_skip[static_cast<size_t>(route)]);
    }
    connected[static_cast<size_t>(j)] = linked;
  }
  for (int64_t j = 0; j < k; ++j) {
    if (!connected[static_cast<size_t>(j)]) continue;
    for (const auto& c : run->cells[static_cast<size_t>(j)]) {
      for (const auto& edge : c.cut.externals) run->externals.add(edge);
    }
  }
  // The stream leaves' devices (pipe_backward.h): every accelerator a stage
  // runs on or a leaf the stages add into lives on (none for CPU stages).
  std::vector<c10::Device> leaf_devices;
  for (const auto& stage : stages_) {
    if (!stage->device().is_cpu()) leaf_devices.push_back(stage->device());
  }
  if (!leaf_devices.empty()) {
    for (const auto& edge : run->externals.edges()) {
      if (const auto* acc = plain_accumulator(edge)) leaf_devices.push_back(acc->variable.device());
    }
  }
  auto leaves = stream_leaf_edges(leaf_devices);
  auto node = std::shared_ptr<PipeBackward>(new PipeBackward(run, leaves.size()),
                                            torch::autograd::deleteNode);
  auto edges = torch::autograd::collect_next_edges(input.values);
  for (size_t v = 0; v < edges.size(); ++v) {
    bool reached = false;
    for (const auto& c : run->cells.front()) {
      reached = reached || (v < c.cut.reached.size() && c.cut.reached[v]);
    }
    if (!(connected.front() && reached)) edges[v] = torch::autograd::Edge();
  }
  for (const auto& edge : run->externals.edges()) edges.push_back(edge);
  for (auto& edge : leaves) edges.push_back(std::move(edge));
  node->set_next_edges(std::move(edges));
  run->output_atomic = out.atomic;
  run->output_slot.assign(out.size(), -1);
  for (size_t v = 0; v < out.size(); ++v) {
    if (!output_requires_grad[v]) continue;
    run->output_slot[v] = static_cast<int64_t>(node->num_inputs());
    torch::autograd::create_gradient_edge(out[v], node);
  }
  return out;
}

}  // namespace gpipe::detail
