// pipe.cpp — PipeImpl: checks and resolves the options, adopts the layers, runs the engine.
#include <gpipe/pipe.h>

#include <gpipe/balance.h>

#include "check.h"
#include "engine.h"
#include "microbatch.h"
#include "sequential_layers.h"
#include "stage.h"

#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <unordered_map>

namespace gpipe {

namespace {

template <typename T>
std::string listed(const std::vector<T>& values) {
  std::ostringstream s;
  s << "{";
  for (size_t i = 0; i < values.size(); ++i) s << (i ? ", " : "") << values[i];
  s << "}";
  return s.str();
}

std::vector<c10::Device> default_devices(size_t stages) {
  if (torch::cuda::is_available()) {
    std::vector<c10::Device> devices;
    const auto n = static_cast<int>(torch::cuda::device_count());
    for (int d = 0; d < n; ++d) devices.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(d));
    return devices;
  }
  return std::vector<c10::Device>(stages, c10::Device(c10::kCPU));
}

/// What puts several stages on each device, for messages: "zb_v runs 2
/// stages on each device (a V)".
std::string stages_per_device(detail::PlanKind kind, int64_t v) {
  return (kind == detail::PlanKind::ZBV ? std::string("schedule zb_v")
                                        : "virtual_stages " + std::to_string(v)) +
         " runs " + std::to_string(v) + " stages on each device" +
         (kind == detail::PlanKind::ZBV ? " (a V)" : "");
}

}  // namespace

PipeImpl::PipeImpl(torch::nn::Sequential sequential, PipeOptions options)
    : sequential_(std::move(sequential)), options_(std::move(options)) {
  GPIPE_CHECK_VALUE(!sequential_.is_empty(), "gpipe::Pipe needs a Sequential, got an empty holder");
  const auto layers = static_cast<int64_t>(sequential_->size());
  GPIPE_CHECK_VALUE(layers > 0, "the Sequential has no layers; give the Pipe at least one layer");

  std::unordered_map<const torch::nn::Module*, int64_t> seen;
  for (int64_t i = 0; i < layers; ++i) {
    const auto* module = sequential_->ptr(static_cast<size_t>(i)).get();
    auto [it, inserted] = seen.emplace(module, i);
    GPIPE_CHECK_VALUE(inserted, "layer ", i, " is the same module object as layer ", it->second,
                      "; each layer of a Pipe must be its own module (its stage owns it), so use a "
                      "separate instance, e.g. a clone()");
  }

  GPIPE_CHECK_VALUE(options_.chunks() >= 1, "chunks must be at least 1, got ", options_.chunks(),
                    "; it is the number of micro-batches per mini-batch");
  int64_t v = options_.virtual_stages();
  GPIPE_CHECK_VALUE(v >= 1, "virtual_stages must be at least 1, got ", v,
                    "; it is the number of stages per device");
  auto layout = detail::stage_layout(options_.schedule_csv(), options_.schedule(), v, "device");
  auto& table = layout.table;
  v = layout.virtual_stages;
  options_.virtual_stages(v);

  if (options_.balance().empty()) {
    // One stage per device given (or per CUDA device), balanced for them.
    auto devices = options_.devices().empty() && torch::cuda::is_available()
                       ? default_devices(0)
                       : options_.devices();
    GPIPE_CHECK_VALUE(!devices.empty(),
                      "balance is empty and there are no devices to count stages by; pass "
                      "PipeOptions().balance({...}) (layers per stage) or .devices({...}) (one per "
                      "stage, e.g. {torch::kCPU, torch::kCPU}) to have a balance computed");
    // Several stages per device fill every device or are refused: leaving
    // some unused would be a silent surprise (one stage per device keeps
    // torchgpipe's rule, as many stages as layers allow).
    const auto given = static_cast<int64_t>(devices.size());
    GPIPE_CHECK_VALUE(v == 1 || layers >= v * given, stages_per_device(layout.kind, v), ", so ",
                      detail::count(given, "device"), " need at least ", v * given,
                      " layers to balance over, but the Sequential has ",
                      detail::count(layers, "layer"), "; pass ",
                      detail::count(std::max<int64_t>(layers / v, 1), "device"),
                      " (or a balance)");
    const auto stages = v * std::min<int64_t>(given, std::max<int64_t>(layers / v, 1));
    options_.balance(options_.sample().defined()
                         ? balance_by_time(stages, sequential_, options_.sample(),
                                           BalanceOptions().device(devices.front()))
                         : balance_by_params(stages, sequential_));
  }
  auto& balance = options_.balance();
  int64_t total = 0;
  for (size_t j = 0; j < balance.size(); ++j) {
    GPIPE_CHECK_VALUE(balance[j] >= 1, "balance ", listed(balance), " gives stage ", j, " ",
                      detail::count(balance[j], "layer"), "; every stage needs at least 1 layer");
    total += balance[j];
  }
  GPIPE_CHECK_VALUE(total == layers, "balance ", listed(balance), " sums to ", total,
                    " but the Sequential has ", detail::count(layers, "layer"),
                    "; pass one entry per stage summing to ", layers);
  const size_t stages = balance.size();
  GPIPE_CHECK_VALUE(stages % static_cast<size_t>(v) == 0, "balance ", listed(balance), " has ",
                    stages, " stages, not a multiple of virtual_stages ", v,
                    "; give virtual_stages entries per device (", v, " x devices)");
  const size_t workers = stages / static_cast<size_t>(v);

  if (options_.devices().empty()) options_.devices(default_devices(workers));
  auto& devices = options_.devices();
  GPIPE_CHECK_INDEX(devices.size() >= workers, "balance ", listed(balance), " asks for ", workers,
                    v > 1 ? " devices (" + std::to_string(v) + " stages each)" : std::string(" stages"),
                    " but only ", detail::count(static_cast<int64_t>(devices.size()), "device"),
                    devices.size() == 1 ? " is" : " are", " given ", listed(devices),
                    "; pass at least one device per stage, or fewer stages");
  GPIPE_CHECK_VALUE(v == 1 || devices.size() == workers, "balance ", listed(balance), " has ",
                    detail::count(static_cast<int64_t>(stages), "stage"), " and ",
                    stages_per_device(layout.kind, v), ", so it uses ",
                    detail::count(static_cast<int64_t>(workers), "device"), ", but ",
                    detail::count(static_cast<int64_t>(devices.size()), "device"), " are given ",
                    listed(devices), "; pass ", detail::count(static_cast<int64_t>(workers), "device"),
                    " to use ", workers, ", or ", v * static_cast<int64_t>(devices.size()),
                    " entries (", v, " per device) to use all ", devices.size());
  devices.erase(devices.begin() + static_cast<std::ptrdiff_t>(workers), devices.end());
  // Stage j runs on worker j mod W, on its device; under ZB-V on the V's worker (plan.h).
  std::vector<c10::Device> stage_devices;
  for (const int64_t w : detail::placement_of(layout.kind, static_cast<int64_t>(workers), v)) {
    stage_devices.push_back(devices[static_cast<size_t>(w)]);
  }

  // A tensor two layers share (tied weights) must live where both run:
  // refuse before anything moves, naming both uses (on one device it is fine).
  {
    struct Use {
      std::string name;
      size_t layer;
      c10::Device device;
    };
    std::unordered_map<const c10::TensorImpl*, Use> uses;
    size_t layer = 0;
    for (size_t j = 0; j < stages; ++j) {
      for (int64_t n = 0; n < balance[j]; ++n, ++layer) {
        const auto module = sequential_->ptr(layer);
        auto check = [&](const std::string& kind, const std::string& name, const at::Tensor& t) {
          if (!t.defined()) return;
          const std::string full = std::to_string(layer) + "." + name;
          auto [found, fresh] =
              uses.try_emplace(t.unsafeGetTensorImpl(), Use{full, layer, stage_devices[j]});
          const Use& first = found->second;
          GPIPE_CHECK_VALUE(fresh || first.device == stage_devices[j], kind, " '", full,
                            "' of layer ", layer, " (on ", stage_devices[j],
                            ") is the same tensor as '", first.name, "' of layer ", first.layer,
                            " (on ", first.device, "), so it cannot live on both devices; put "
                            "those layers on one device, or untie the weights");
        };
        for (const auto& p : module->named_parameters()) check("parameter", p.key(), p.value());
        for (const auto& b : module->named_buffers()) check("buffer", b.key(), b.value());
      }
    }
  }

  // Adopt the layers under the Sequential's own names, so parameters and
  // state_dict keys read "0.weight" as in the Sequential.
  for (const auto& item : sequential_->named_children()) register_module(item.key(), item.value());

  // Skips crossing stages become routes (see detail::SkipLayout).
  auto skips = detail::skip_layout(sequential_, balance);

  std::vector<std::unique_ptr<detail::Layers>> parts;
  int64_t offset = 0;
  auto it = sequential_->begin();
  for (size_t j = 0; j < stages; ++j) {
    std::vector<torch::nn::AnyModule> modules;
    for (int64_t n = 0; n < balance[j]; ++n, ++it) {
      it->ptr()->to(stage_devices[j]);
      modules.push_back(*it);
    }
    parts.push_back(std::make_unique<detail::SequentialLayers>(
        std::move(modules), offset, std::move(skips.arriving[j]), std::move(skips.leaving[j])));
    offset += balance[j];
  }
  engine_ = std::make_shared<detail::Engine>(std::move(parts), stage_devices, options_.chunks(),
                                             options_.checkpoint(), options_.intra_op_threads(),
                                             v, layout.kind);
  engine_->set_batch_dims(options_.batch_dim(), options_.output_batch_dim());
  engine_->set_skip_routes(std::move(skips.routes));
  engine_->tracer().set_capacity(options_.trace_capacity());
  engine_->tracer().enable(options_.trace());
  if (table) engine_->set_plan(std::move(*table));
  if (!options_.stage_checkpoints().empty()) {
    engine_->set_stage_checkpoints(options_.stage_checkpoints());
  }
}

std::string PipeImpl::schedule_csv() {
  return detail::plan_to_csv(engine_->plan(options_.chunks()));
}

PipeImpl::~PipeImpl() = default;

torch::Tensor PipeImpl::forward(const torch::Tensor& input) {
  auto out = engine_->forward(detail::Batch(input), is_training());
  GPIPE_CHECK_VALUE(out.atomic && out.size() == 1, "the Pipe's last layer returned ", out.size(),
              " tensors; call forward_tuple to get them all");
  return out[0];
}

std::vector<torch::Tensor> PipeImpl::forward_tuple(std::vector<torch::Tensor> inputs) {
  return engine_->forward(detail::Batch(std::move(inputs), /*is_atomic=*/false), is_training())
      .values;
}

std::vector<torch::Tensor> PipeImpl::forward_tuple(const torch::Tensor& input) {
  return engine_->forward(detail::Batch(input), is_training()).values;
}

torch::Tensor PipeImpl::train_step(const torch::Tensor& input, const torch::Tensor& target,
                                   const LossFn& loss_fn) {
  GPIPE_CHECK_VALUE(static_cast<bool>(loss_fn), "train_step needs a loss_fn, got an empty one");
  return engine_->train_step(
      detail::Batch(input), detail::Batch(target),
      [&](const detail::Batch& output, const detail::Batch& target_mb) {
        GPIPE_CHECK_VALUE(output.atomic && output.size() == 1, "the Pipe's last layer returned ",
                          output.size(), " tensors; call train_step_tuple to get them all");
        return loss_fn(output[0], target_mb[0]);
      },
      is_training());
}

torch::Tensor PipeImpl::train_step_tuple(std::vector<torch::Tensor> inputs,
                                         std::vector<torch::Tensor> targets,
                                         const TupleLossFn& loss_fn) {
  GPIPE_CHECK_VALUE(static_cast<bool>(loss_fn), "train_step_tuple needs a loss_fn, got an empty one");
  return engine_->train_step(
      detail::Batch(std::move(inputs), /*is_atomic=*/false),
      detail::Batch(std::move(targets), /*is_atomic=*/false),
      [&](const detail::Batch& output, const detail::Batch& target_mb) {
        return loss_fn(output.values, target_mb.values);
      },
      is_training());
}

void PipeImpl::set_tracing(bool on) {
  options_.trace(on);
  engine_->tracer().enable(on);
}

bool PipeImpl::tracing() const { return engine_->tracer().enabled(); }

Trace PipeImpl::trace() const { return engine_->tracer().snapshot(); }

void PipeImpl::clear_trace() { engine_->tracer().clear(); }

size_t PipeImpl::size() const noexcept { return sequential_->size(); }

std::shared_ptr<torch::nn::Module> PipeImpl::ptr(size_t index) const {
  GPIPE_CHECK_INDEX(index < size(), "index ", index, " is out of range for a Pipe of ",
                    detail::count(static_cast<int64_t>(size()), "layer"));
  return sequential_->ptr(index);
}

void PipeImpl::to(torch::Device device, torch::Dtype /*dtype*/, bool /*non_blocking*/) {
  to(device);
}

void PipeImpl::to(torch::Device device, bool /*non_blocking*/) {
  GPIPE_CHECK_VALUE(false, "a Pipe keeps each stage on its own device ", listed(devices()),
              " and cannot be moved as a whole to ", device,
              "; choose devices with PipeOptions().devices(...), or cast with to(dtype)");
}

std::shared_ptr<torch::nn::Module> PipeImpl::clone(const std::optional<torch::Device>& device) const {
  GPIPE_CHECK_VALUE(!device, "Pipe::clone(", device ? c10::str(*device) : "", ") would put the "
                    "copy on one device, but a Pipe's stages keep their devices ",
                    listed(devices()), "; call clone() with no device (a copy on the same "
                    "devices), or wrap sequential()->clone() in a new Pipe with "
                    "PipeOptions().devices({...})");
  // Layer by layer, so a layer that cannot be cloned is named; a tensor two
  // layers share would come back as two (each layer clones its own), so it is
  // refused rather than silently untied.
  std::unordered_map<const c10::TensorImpl*, size_t> owner;
  torch::nn::Sequential copy;
  const auto children = sequential_->named_children();
  size_t i = 0;
  for (const auto& layer : *sequential_) {
    for (const auto& tensor : layer.ptr()->parameters()) {
      const auto [it, inserted] = owner.emplace(tensor.unsafeGetTensorImpl(), i);
      GPIPE_CHECK_VALUE(inserted || it->second == i, "Pipe::clone: layers ", it->second, " and ",
                        i, " share a parameter (tied weights), which a clone would untie; build "
                        "a new Pipe over a Sequential whose layers share it again");
    }
    torch::nn::AnyModule cloned;
    try {
      cloned = layer.clone();
    } catch (const c10::Error& e) {
      detail::throw_value_error(c10::str(
          "Pipe::clone: layer ", i, " (", layer.ptr()->name(), ") cannot be cloned: ",
          detail::first_line(e.what_without_backtrace()),
          "; derive it from torch::nn::Cloneable, or build a new Pipe over a copy you make"));
    }
    copy->push_back(children[i].key(), std::move(cloned));
    ++i;
  }
  return std::make_shared<PipeImpl>(std::move(copy), options_);
}

void PipeImpl::pretty_print(std::ostream& stream) const {
  stream << "gpipe::Pipe(balance=" << listed(balance()) << ", devices=" << listed(devices())
         << ", chunks=" << chunks() << ", checkpoint=";
  if (options_.stage_checkpoints().empty()) {
    stream << checkpoint();
  } else {
    stream << listed(options_.stage_checkpoints());
  }
  stream << ", schedule=";
  if (options_.schedule_csv().empty()) {
    stream << options_.schedule();
  } else {
    stream << "table";  // schedule_csv() shows it
  }
  if (options_.virtual_stages() != 1) stream << ", virtual_stages=" << options_.virtual_stages();
  const auto& dims = options_.batch_dim();
  if (!(dims.size() == 1 && dims.front() == 0)) {
    stream << ", batch_dim={";
    for (size_t v = 0; v < dims.size(); ++v) {
      stream << (v ? ", " : "");
      if (dims[v]) {
        stream << *dims[v];
      } else {
        stream << "nullopt";
      }
    }
    stream << "}";
  }
  stream << ")";
}

}  // namespace gpipe
