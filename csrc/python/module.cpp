// module.cpp — gpipe._C: the engine for Python layers, and the phase flags. Thin: logic lives in csrc/.
#include "../engine.h"
#include "../profile.h"
#include "py_layers.h"

#include <gpipe/balance.h>
#include <gpipe/error.h>
#include <gpipe/phase.h>
#include <gpipe/trace.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <optional>
#include <string>
#include <tuple>

namespace py = pybind11;

namespace gpipe::python {

namespace {

gpipe::Checkpoint parse_checkpoint(const std::string& mode) {
  if (mode == "always") return gpipe::Checkpoint::Always;
  if (mode == "except_last") return gpipe::Checkpoint::ExceptLast;
  if (mode == "never") return gpipe::Checkpoint::Never;
  throw py::value_error("checkpoint is not one of 'always', 'except_last', or 'never', got '" +
                        mode + "'");
}

// A layer's Python exception goes back to Python as itself (same type, same
// object), with a note saying where it happened. Other errors stay
// CellErrors (RuntimeError in Python).
void reraise_python(const gpipe::CellError& error) {
  py::gil_scoped_acquire gil;
  const std::string where = "gpipe: raised in stage " + std::to_string(error.stage()) +
                            ", micro-batch " + std::to_string(error.microbatch()) + ", " +
                            error.phase();
  // The exception object travels in the C++ exception; the thread's Python
  // error indicator may still hold it too: torch's Python engine sets it
  // (python_error::restore) before rethrowing from a nested backward. Here
  // that is the case when the failed cell ran inline on an autograd device
  // thread (its thread state lives on), and a pending error would make the
  // add_note call below fail and raise the error without its note.
  PyErr_Clear();
  auto add_note = [&](py::handle value) {
    if (value && py::hasattr(value, "add_note")) value.attr("add_note")(where);
  };
  try {
    std::rethrow_exception(error.original());
  } catch (py::error_already_set& e) {
    add_note(e.value());
    throw;
  } catch (python_error& e) {
    // Raised by a Python autograd Function inside a stage's backward.
    add_note(e.value);
    Py_XINCREF(e.type);
    Py_XINCREF(e.value);
    Py_XINCREF(e.traceback);
    PyErr_Restore(e.type, e.value, e.traceback);
    throw py::error_already_set();
  } catch (...) {
  }
}

// A schedule CSV's plan; ValueError naming the bad cell or task.
detail::Plan plan_from_csv_or_raise(const std::string& text) {
  try {
    detail::Plan plan = detail::plan_from_csv(text);
    detail::require_runnable_placement(plan);  // a Schedule is for running
    return plan;
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
}

detail::PlanKind parse_schedule(const std::string& name) {
  if (name == "gpipe") return detail::PlanKind::GPipe;
  if (name == "1f1b") return detail::PlanKind::OneFOneB;
  if (name == "interleaved_1f1b") return detail::PlanKind::Interleaved1F1B;
  if (name == "zb_h1") return detail::PlanKind::ZBH1;
  if (name == "zb_v") return detail::PlanKind::ZBV;
  throw py::value_error("schedule is not one of 'gpipe', '1f1b', 'interleaved_1f1b', 'zb_h1' or "
                        "'zb_v', got '" + name + "'");
}

class PyEngine {
 public:
  PyEngine(const py::list& partitions, const std::vector<c10::Device>& devices, int64_t chunks,
           const std::string& checkpoint, int64_t intra_op_threads, int64_t virtual_stages,
           const std::string& schedule,
           const std::vector<std::pair<int64_t, int64_t>>& skip_routes,
           const std::string& group, const std::string& reverse_group,
           const std::string& dp_group) {
    // The group crosses from Python by name: the registry torch.distributed
    // fills is libtorch's own, so this works whatever pybind11 build made
    // the Python object. Over a group, partition j is this rank's j-th stage
    // of the whole pipeline (rank + j * size in a loop; rank, then
    // 2 size - 1 - rank in ZB-V's V), and skip routes name whole-pipeline
    // stages.
    detail::Groups groups;
    if (!group.empty()) groups.pipeline = c10d::resolve_process_group(group);
    if (!reverse_group.empty()) groups.reverse = c10d::resolve_process_group(reverse_group);
    if (!dp_group.empty()) groups.data = c10d::resolve_process_group(dp_group);
    const auto& pg = groups.pipeline;
    const size_t all = pg ? static_cast<size_t>(virtual_stages * pg->getSize()) : partitions.size();
    std::vector<size_t> own;  // over a group: this rank's stages, in order
    if (pg) {
      const auto placement =
          detail::placement_of(parse_schedule(schedule), pg->getSize(), virtual_stages);
      for (size_t s = 0; s < placement.size(); ++s) {
        if (placement[s] == pg->getRank()) own.push_back(s);
      }
    }
    auto global = [&](size_t j) { return pg ? (j < own.size() ? own[j] : all) : j; };
    std::vector<detail::SkipRoute> routes;
    std::vector<size_t> arriving(all, 0), leaving(all, 0);
    for (const auto& [from, to] : skip_routes) {
      TORCH_CHECK(0 <= from && from < to && static_cast<size_t>(to) < all,
                  "skip route from stage ", from, " to stage ", to, " for ", all, " stages");
      routes.push_back(detail::SkipRoute{from, to});
      ++leaving[static_cast<size_t>(from)];
      ++arriving[static_cast<size_t>(to)];
    }
    std::vector<std::unique_ptr<detail::Layers>> stages;
    for (size_t j = 0; j < partitions.size(); ++j) {
      const size_t g = global(j);
      TORCH_CHECK(g < all, "partition ", j, " of this rank is stage ", g, " of ", all);
      stages.push_back(std::make_unique<PyLayers>(py::reinterpret_borrow<py::object>(partitions[j]),
                                                  static_cast<int64_t>(g), arriving[g],
                                                  leaving[g]));
    }
    TORCH_CHECK(!stages.empty(), "a Pipe needs at least one stage");
    TORCH_CHECK(devices.size() >= stages.size(), "got ", devices.size(), " devices for ",
                stages.size(), " stages");
    TORCH_CHECK(chunks >= 1, "chunks must be at least 1, got ", chunks);
    TORCH_CHECK(virtual_stages >= 1 && stages.size() % static_cast<size_t>(virtual_stages) == 0,
                "got ", stages.size(), " stages for virtual_stages ", virtual_stages);
    engine_ = std::make_shared<detail::Engine>(std::move(stages), devices, chunks,
                                               parse_checkpoint(checkpoint), intra_op_threads,
                                               virtual_stages, parse_schedule(schedule),
                                               std::move(groups));
    engine_->set_skip_routes(std::move(routes));
    engine_->set_error_hook(reraise_python);
    engine_->set_loss_example("torch.nn.functional.mse_loss(output, target)");
  }

  ~PyEngine() {
    // Dropping the engine joins its workers. A worker may still hold
    // autograd nodes of a backward that failed (queued on its thread), and
    // frees them as it exits, which releases Python tensors: it needs the
    // GIL, so the join must not hold it. (Python objects the engine holds,
    // the stages' layers, take the GIL themselves as they go.)
    py::gil_scoped_release no_gil;
    engine_.reset();
  }
  PyEngine(const PyEngine&) = delete;
  PyEngine& operator=(const PyEngine&) = delete;

  py::object forward(py::handle input, bool training) {
    detail::Batch batch = to_batch(input, "input");
    detail::Batch out;
    {
      py::gil_scoped_release no_gil;  // the workers take it to call the layers
      out = engine_->forward(batch, training);
    }
    return to_python(out);
  }

  // Across ranks, the input is None except on the first, the target None
  // except on the last: an empty batch; so is the loss elsewhere.
  py::object train_step(py::handle input, py::handle target, const py::function& loss_fn,
                        bool training) {
    detail::Batch batch;
    detail::Batch targets;
    try {
      batch = input.is_none() ? detail::Batch() : to_batch(input, "input");
      targets = target.is_none() ? detail::Batch() : to_batch(target, "target");
    } catch (const std::exception& e) {
      engine_->abandon_step(e.what(), /*training_step=*/true);
      throw;
    }
    // Called on the last stage's worker: takes the GIL for the call only.
    const detail::LossFn fn = [&loss_fn](const detail::Batch& out, const detail::Batch& t) {
      py::gil_scoped_acquire gil;
      py::object loss = loss_fn(to_python(out), to_python(t));
      if (!THPVariable_Check(loss.ptr())) {
        const std::string type = py::str(py::type::of(loss).attr("__name__"));
        PyErr_SetString(PyExc_TypeError,
                        ("loss_fn must return a tensor (the micro-batch's loss), got " + type).c_str());
        throw py::error_already_set();
      }
      return THPVariable_Unpack(loss.ptr());
    };
    at::Tensor loss;
    {
      py::gil_scoped_release no_gil;  // the workers take it to call the layers
      loss = engine_->train_step(batch, targets, fn, training);
    }
    if (!loss.defined()) return py::none();
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(loss));
  }

  py::object eval_step(py::handle input) {
    detail::Batch batch;
    try {
      batch = input.is_none() ? detail::Batch() : to_batch(input, "input");
    } catch (const std::exception& e) {
      engine_->abandon_step(e.what(), /*training_step=*/false);
      throw;
    }
    detail::Batch out;
    {
      py::gil_scoped_release no_gil;
      out = engine_->eval_step(batch);
    }
    if (out.values.empty()) return py::none();
    return to_python(out);
  }

  void set_batch_dims(detail::BatchDims input, detail::BatchDims output) {
    engine_->set_batch_dims(std::move(input), std::move(output));
  }

  int64_t microbatches(py::handle input) {
    return engine_->microbatches(to_batch(input, "input"));
  }

  void abandon_step(const std::string& what, bool training_step) {
    engine_->abandon_step(what, training_step);
  }

  void check_agreement(const std::vector<std::pair<std::string, std::string>>& settings,
                       const std::string& what) {
    std::vector<detail::Setting> own;
    for (const auto& [name, value] : settings) own.push_back({name, value});
    engine_->check_agreement(own, what);
  }

  // One tie per entry: (uses, owners, tensor, here, group). `tensor` is the
  // parameter in this rank's whole model (its replica where `here`);
  // `group`: the owners' group's name ("" on other ranks).
  using PyTie = std::tuple<std::vector<std::string>, std::vector<int64_t>, at::Tensor, bool,
                           std::string>;
  void set_ties(const std::vector<PyTie>& ties) {
    std::vector<detail::Tie> own;
    for (const auto& [uses, owners, tensor, here, group] : ties) {
      detail::Tie tie;
      tie.uses = uses;
      tie.owners = owners;
      if (here) tie.replica = tensor;
      tie.sizes = tensor.sizes().vec();
      tie.dtype = tensor.scalar_type();
      tie.requires_grad = tensor.requires_grad();
      // Python makes each tie's owners a group of their own.
      tie.owners_only = true;
      if (here) tie.group = c10d::resolve_process_group(group);
      own.push_back(std::move(tie));
    }
    engine_->set_ties(std::move(own));
  }

  void set_tie_replicas(const std::vector<std::optional<at::Tensor>>& replicas) {
    std::vector<at::Tensor> own;
    for (const auto& replica : replicas) own.push_back(replica.value_or(at::Tensor()));
    engine_->set_tie_replicas(own);
  }

  void set_bucket_cap(int64_t bytes) { engine_->set_bucket_cap(bytes); }
  void set_step_timeout(double seconds) {
    engine_->set_step_timeout(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0)));
  }
  void set_stage_checkpoints(const std::vector<std::string>& modes) {
    std::vector<gpipe::Checkpoint> parsed;
    for (const auto& m : modes) parsed.push_back(parse_checkpoint(m));
    engine_->set_stage_checkpoints(std::move(parsed));
  }
  void set_plan_csv(const std::string& text) { engine_->set_plan(plan_from_csv_or_raise(text)); }
  std::string plan_csv(int64_t microbatches) {
    return detail::plan_to_csv(engine_->plan(microbatches));
  }
  std::vector<std::tuple<int64_t, int64_t, int64_t>> grad_reduce_launches() const {
    std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
    for (const auto& l : engine_->grad_reduce_launches()) out.emplace_back(l.stage, l.tasks_left, l.buckets);
    return out;
  }

  detail::Tracer& tracer() { return engine_->tracer(); }
  const std::vector<int>& intra_op_threads() const { return engine_->intra_op_threads(); }
  std::string handoffs() const { return engine_->handoffs(); }

 private:
  std::shared_ptr<detail::Engine> engine_;
};

// Counts bytes allocated minus freed on this thread inside a `with` block.
class PyMemoryCounter {
 public:
  PyMemoryCounter& enter() {
    counting_.emplace();
    return *this;
  }
  void exit(const py::args& /*exc*/) {
    last_ = current();
    counting_.reset();
  }
  int64_t current() const { return counting_ ? counting_->counter().current() : last_; }

 private:
  std::optional<detail::CountMemory> counting_;
  int64_t last_ = 0;
};

}  // namespace

}  // namespace gpipe::python

PYBIND11_MODULE(_C, m) {
  using gpipe::python::PyEngine;
  m.doc() = "gpipe's C++ engine (private: use gpipe.Pipe).";

  py::class_<PyEngine>(m, "Engine", "Runs stages of Python modules as a GPipe pipeline.")
      .def(py::init<const py::list&, const std::vector<c10::Device>&, int64_t,
                    const std::string&, int64_t, int64_t, const std::string&,
                    const std::vector<std::pair<int64_t, int64_t>>&, const std::string&,
                    const std::string&, const std::string&>(),
           py::arg("partitions"), py::arg("devices"), py::arg("chunks"), py::arg("checkpoint"),
           py::arg("intra_op_threads") = 0, py::arg("virtual_stages") = 1,
           py::arg("schedule") = "1f1b",
           py::arg("skip_routes") = std::vector<std::pair<int64_t, int64_t>>(),
           py::arg("group") = "", py::arg("reverse_group") = "", py::arg("dp_group") = "",
           R"doc(partitions: one list of modules per stage, or a gpipe.skip StageRunner for a
stage with skips; devices: one per stage;
chunks: micro-batches per mini-batch; checkpoint: 'always', 'except_last' or 'never';
intra_op_threads: 0 splits this thread's torch.get_num_threads() between the CPU workers,
N > 0 gives each CPU worker N, -1 leaves torch's setting; virtual_stages: stages per worker
(stage s runs on worker s % workers); schedule: train_step's order, 'gpipe', '1f1b',
'interleaved_1f1b' or 'zb_h1'; skip_routes: (stashing stage, popping stage) per skip across stages, in the order the runners take and give them;
group: a torch.distributed group's name (group_name) for a pipeline over its ranks: partitions
are then this rank's stages (stage s on rank s % size, virtual_stages per rank; under zb_v
rank r holds stages r and 2 size - 1 - r); empty: every
stage in this process; reverse_group: the same ranks again, for hand-offs to lower ranks over
NCCL (empty: group); dp_group: this rank's data-parallel replicas, grads averaged over it.)doc")
      .def("train_step", &PyEngine::train_step, py::arg("input"), py::arg("target"),
           py::arg("loss_fn"), py::arg("training"),
           R"doc(One training step inside the pipeline: forward, loss_fn(output, target) per
micro-batch (scaled by its share of the rows), backward, in the schedule's order; returns the
batch's loss, detached (None on a rank without the last stage).)doc")
      .def(
          "abandon_step",
          [](PyEngine& e, const std::string& what, bool training_step) {
            e.abandon_step(what, training_step);
          },
          py::arg("what"), py::arg("training_step"), py::call_guard<py::gil_scoped_release>(),
          R"doc(Over a process group: fails the step this rank was about to run (an error found
before it, in Python), so the other ranks fail too, naming this rank and `what`.)doc")
      .def("check_agreement", &PyEngine::check_agreement, py::arg("settings"), py::arg("what"),
           py::call_guard<py::gil_scoped_release>(),
           R"doc(Over a process group: every rank's (name, value) settings compared (two
all_reduces); a ValueError on every rank naming each setting the ranks disagree on.)doc")
      .def("set_ties", &PyEngine::set_ties, py::arg("ties"),
           py::call_guard<py::gil_scoped_release>(),
           R"doc(Over a process group: the parameters this rank shares with others, as (uses,
owners, tensor, here, group name) tuples; replicas are set to the lowest owner's now, and their
grads summed over the owners after every train_step.)doc")
      .def("set_tie_replicas", &PyEngine::set_tie_replicas, py::arg("replicas"),
           py::call_guard<py::gil_scoped_release>(),
           R"doc(The tensors whose grads later train_steps sum for this rank's ties, one per tie
of set_ties in order (None: keep the one there), e.g. FSDP2's unsharded copy of a parameter.)doc")
      .def("eval_step", &PyEngine::eval_step, py::arg("input"),
           R"doc(Pipelined inference over the group's ranks (no grad): the gathered output on
the rank of the last stage, None elsewhere.)doc")
      .def_property_readonly(
          "handoffs", [](const PyEngine& e) { return e.handoffs(); },
          "How batches travel between stages: 'in-process', or over a group 'tagged' (Gloo) or "
          "'ordered' (NCCL, or GPIPE_HANDOFFS=ordered).")
      .def_property_readonly(
          "intra_op_threads", [](const PyEngine& e) { return e.intra_op_threads(); },
          "Each stage worker's intra-op thread count as set (0: left to torch).")
      .def("forward", &PyEngine::forward, py::arg("input"), py::arg("training"),
           R"doc(Runs a tensor or a tuple of tensors through the pipeline; under grad mode
the outputs' grad_fn runs the backward half when backward() reaches it.)doc")
      .def("set_batch_dims", &PyEngine::set_batch_dims, py::arg("input"), py::arg("output"),
           R"doc(Where inputs are cut and outputs joined: one entry for every value or
one per value, None for a value not cut; an empty output list follows input.)doc")
      .def("microbatches", &PyEngine::microbatches, py::arg("input"),
           "How many micro-batches the input makes.")
      .def_property(
          "tracing", [](PyEngine& e) { return e.tracer().enabled(); },
          [](PyEngine& e, bool on) { e.tracer().enable(on); },
          "Whether every cell is being recorded.")
      .def(
          "trace", [](PyEngine& e) { return e.tracer().snapshot(); },
          "The events recorded so far (a copy); waits for device-timed cells to finish.",
          py::call_guard<py::gil_scoped_release>())
      .def(
          "clear_trace", [](PyEngine& e) { e.tracer().clear(); },
          "Forgets the recorded events; the next forward is step 0.")
      .def_property(
          "trace_capacity", [](PyEngine& e) { return e.tracer().capacity(); },
          [](PyEngine& e, int64_t events) { e.tracer().set_capacity(events); },
          "The most recent events tracing keeps, whole steps (see Trace); at least 1.")
      .def_property_readonly(
          "trace_origin_ns",
          [](PyEngine& e) {
            return static_cast<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                            e.tracer().origin().time_since_epoch())
                                            .count());
          },
          "Where the trace's times count from, in nanoseconds on the host's steady clock "
          "(CLOCK_MONOTONIC on Linux, as time.monotonic_ns()): origin + start_us lines up "
          "the traces of several processes on one machine.")
      .def("set_stage_checkpoints", &PyEngine::set_stage_checkpoints, py::arg("modes"),
           "A checkpoint mode per stage (the pipeline's), in place of the one mode.")
      .def("set_plan_csv", &PyEngine::set_plan_csv, py::arg("text"),
           "Makes train_step run the schedule in torch.distributed.pipelining's CSV format "
           "(one row of compute actions per device or rank); ValueError when it does not fit "
           "the pipe or deadlocks.")
      .def("plan_csv", &PyEngine::plan_csv, py::arg("microbatches"),
           "The plan train_step runs for that many micro-batches, as that CSV.")
      .def("set_bucket_cap", &PyEngine::set_bucket_cap, py::arg("bytes"),
           "With dp_group: the most bytes of grads averaged in one all_reduce (a parameter is "
           "never split); at least 1.")
      .def("set_step_timeout", &PyEngine::set_step_timeout, py::arg("seconds"),
           "Over a process group: how long this rank waits for another before the step fails "
           "naming what it waited for; 0: the group's own timeout.")
      .def("grad_reduce_launches", &PyEngine::grad_reduce_launches,
           "With dp_group: the last training step's bucket launches, in order, as (stage, "
           "tasks of this rank's list still to run, buckets); stage -1: started at the step's "
           "end.");

  py::class_<gpipe::TraceEvent>(m, "TraceEvent", R"doc(One executed action: a cell (one stage's
forward, recompute or backward of one micro-batch) or a copy of a stage's input from another
device. Times are microseconds on the host's steady clock since the Pipe was built: a CPU
stage's actions are timed on the host; an accelerator stage's by events on its stream (when the
device ran the work, not when the host queued it), placed on the host timeline.)doc")
      .def_readonly("step", &gpipe::TraceEvent::step,
                    "The forward call it belongs to (0, 1, ... since tracing started or the "
                    "trace was cleared); a backward belongs to the step of its forward.")
      .def_readonly("stage", &gpipe::TraceEvent::stage, "Index of the stage that ran it.")
      .def_readonly("microbatch", &gpipe::TraceEvent::microbatch,
                    "Index of the micro-batch within its step (0: the first rows).")
      .def_property_readonly(
          "phase", [](const gpipe::TraceEvent& e) { return std::string(gpipe::to_string(e.phase)); },
          "'forward', 'backward', 'recompute' (a checkpointed cell's forward again, just "
          "before its backward), 'copy', and under train_step 'loss' (the last stage's loss "
          "and its grad), 'input_grad' and 'weight_grad' (zero-bubble's halves of a backward); "
          "over a process group 'send' (issuing a hand-off to another rank's stage) and "
          "'receive' (waiting for one from another rank's stage, bubble included).")
      .def_readonly("peer", &gpipe::TraceEvent::peer,
                    "'send' and 'receive': the stage at the other end of the hand-off (the "
                    "receiving stage of a send, the sending stage of a receive); -1 otherwise.")
      .def_readonly("start_us", &gpipe::TraceEvent::start_us,
                    "When it started, in microseconds since the Pipe was built.")
      .def_readonly("end_us", &gpipe::TraceEvent::end_us,
                    "When it ended, in microseconds since the Pipe was built (>= start_us).")
      .def_readonly("thread", &gpipe::TraceEvent::thread,
                    "A small number per OS thread (the stage's worker, or the caller's thread "
                    "where a backward runs inline), numbered across the process.")
      .def("__repr__", [](const gpipe::TraceEvent& e) {
        return "TraceEvent(step=" + std::to_string(e.step) + ", stage=" + std::to_string(e.stage) +
               ", microbatch=" + std::to_string(e.microbatch) + ", phase='" +
               gpipe::to_string(e.phase) + "', start_us=" + std::to_string(e.start_us) +
               ", end_us=" + std::to_string(e.end_us) + ", thread=" + std::to_string(e.thread) +
               (e.peer >= 0 ? ", peer=" + std::to_string(e.peer) : std::string()) + ")";
      });

  py::class_<gpipe::TraceSummary>(m, "TraceSummary", R"doc(The measured bubble against GPipe's
ideal, and busy time per stage. Each step has two halves, forward (forward events) and backward
(recompute and backward events); a half's span runs from its first event's start to its last
event's end. Copies count toward no stage's busy time.)doc")
      .def_readonly("stages", &gpipe::TraceSummary::stages,
                    "Stages seen in the trace (highest stage index + 1).")
      .def_readonly("microbatches", &gpipe::TraceSummary::microbatches,
                    "The most micro-batches any step had.")
      .def_readonly("steps", &gpipe::TraceSummary::steps, "Steps with events in the trace.")
      .def_readonly("busy_us", &gpipe::TraceSummary::busy_us,
                    "Per stage: microseconds spent in forward, recompute and backward events.")
      .def_readonly("span_us", &gpipe::TraceSummary::span_us,
                    "Sum of the spans of every half of every step, in microseconds (the gaps "
                    "between halves, the caller's own code, are left out).")
      .def_readonly("bubble", &gpipe::TraceSummary::bubble,
                    "The measured idle share of the stages' time inside the spans: "
                    "1 - sum(busy_us) / (stages * span_us). Includes fill and drain, imbalance "
                    "between stages and the engine's overhead between cells.")
      .def_readonly("ideal_bubble", &gpipe::TraceSummary::ideal_bubble,
                    "GPipe's bubble for balanced stages and free hand-offs: (K-1)/(M+K-1), "
                    "K = stages, M = microbatches.")
      .def("__str__", &gpipe::TraceSummary::to_string);

  py::class_<gpipe::Trace>(m, "Trace", R"doc(What a Pipe ran while tracing was on: its events, in
the order they ended. A Pipe keeps at most its trace capacity of the most recent events
(default 100,000; Pipe.trace_capacity), dropping whole steps, oldest first, so summary()
measures complete steps; `dropped` counts the events no longer kept.)doc")
      .def(py::init<>())
      .def_readwrite("events", &gpipe::Trace::events, "The kept events (list of TraceEvent).")
      .def_readwrite("dropped", &gpipe::Trace::dropped,
                     "Events recorded but no longer kept (oldest steps beyond the capacity).")
      .def("to_chrome_json", &gpipe::Trace::to_chrome_json,
           "Chrome trace event JSON (chrome://tracing, ui.perfetto.dev): a row per stage.")
      .def("save_chrome_json", &gpipe::Trace::save_chrome_json, py::arg("path"),
           "Writes to_chrome_json() to path.")
      .def("summary", &gpipe::Trace::summary,
           "The measured bubble against GPipe's ideal and busy time per stage (a TraceSummary).")
      .def(
          "__len__", [](const gpipe::Trace& t) { return t.events.size(); },
          "Number of kept events.");

  m.attr("DEFAULT_TRACE_CAPACITY") = gpipe::kDefaultTraceCapacity;

  py::class_<gpipe::python::PyMemoryCounter>(
      m, "MemoryCounter",
      "Context manager: bytes allocated minus bytes freed on this thread while inside (any device).")
      .def(py::init<>())
      .def("__enter__", &gpipe::python::PyMemoryCounter::enter, py::return_value_policy::reference)
      .def("__exit__", &gpipe::python::PyMemoryCounter::exit)
      .def_property_readonly("current", &gpipe::python::PyMemoryCounter::current);

  m.def(
      "parse_schedule_csv",
      [](const std::string& text) {
        const gpipe::detail::Plan plan = gpipe::python::plan_from_csv_or_raise(text);
        return std::make_tuple(plan.workers, plan.stages, plan.microbatches,
                               gpipe::detail::plan_to_csv(plan), gpipe::detail::v_placed(plan));
      },
      py::arg("text"),
      R"doc(Checks a schedule in torch.distributed.pipelining's CSV format ("compute_only": one row
per rank, actions like 0F3, 1I2, 1W2, 0B1, empty cells idle) and returns (rows, stages,
micro-batches, the CSV without idle cells, v_shaped); ValueError naming the bad cell, a misplaced or
missing action, or the actions a deadlocked table waits on; and whether its stages lie in ZB-V's V
(else a loop).)doc");
  m.def("balance_cost", &gpipe::balance_cost, py::arg("costs"), py::arg("partitions"),
        R"doc(The contiguous split of per-layer costs into `partitions` stages minimising the
largest stage (exact; ties: lexicographically smallest balance).)doc");

  m.def("is_checkpointing", &gpipe::is_checkpointing,
        R"doc(True inside the first forward of a checkpointed micro-batch (no graph kept).)doc");
  m.def("is_recomputing", &gpipe::is_recomputing,
        R"doc(True inside the recompute of a checkpointed micro-batch, just before its backward.)doc");
}
