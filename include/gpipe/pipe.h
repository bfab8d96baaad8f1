// pipe.h — gpipe::Pipe, the module that trains a Sequential as a GPipe pipeline.
#pragma once

#include <gpipe/options.h>
#include <gpipe/trace.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace gpipe {

namespace detail {
class Engine;
}  // namespace detail

/// Runs a `torch::nn::Sequential` as a pipeline: its layers are cut into
/// consecutive stages (see `PipeOptions::balance`), one per device, and each
/// mini-batch into `chunks` micro-batches that flow through the stages on one
/// worker thread per stage. Outputs and gradients equal the Sequential's.
///
/// See `PipeOptions` for the options. The Pipe takes the Sequential's layers
/// as its own children under the Sequential's names ("0", "1", ...), moves
/// each to its stage's device, and drops into an unchanged training loop:
///
/// Example:
/// ```
/// torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::ReLU(),
///                             torch::nn::Linear(32, 1));
/// gpipe::Pipe pipe(model, gpipe::PipeOptions().balance({2, 1}).chunks(4));
/// torch::optim::SGD sgd(pipe->parameters(), 0.1);
/// auto loss = torch::mse_loss(pipe->forward(x), y);
/// sgd.zero_grad();
/// loss.backward();  // runs the backward half of the schedule
/// sgd.step();
/// ```
///
/// In training with grad mode on, micro-batches selected by
/// `PipeOptions::checkpoint` keep only their stage inputs and are recomputed
/// just before their backward, replaying the same random numbers. Under
/// `torch::NoGradGuard` no graph is kept; in `eval()` mode nothing is
/// checkpointed.
///
/// Autograd sees what it sees with the plain Sequential: an output requires
/// grad where the Sequential's would; every tensor the layers use that
/// requires grad (parameters, tied weights, closures) gets its grad, summed
/// over micro-batches and accumulated once per backward; `autograd::grad`
/// and `backward(inputs)` fill no other `.grad`. An input changed in place
/// before backward raises autograd's "modified by an inplace operation".
///
/// Thread safety: one forward or backward runs at a time per Pipe; callers
/// on other threads wait. Calling a Pipe from inside a layer of a Pipe
/// throws at once.
class PipeImpl : public torch::nn::Module {
 public:
  PipeImpl(torch::nn::Sequential sequential, PipeOptions options);
  ~PipeImpl() override;

  /// Runs `input` through the pipeline; the result lives on the last stage's
  /// device. The batch is cut along `PipeOptions::batch_dim` (dim 0 by
  /// default) and the outputs joined along `output_batch_dim`. The last
  /// layer must return one tensor. The only `forward`, so a Pipe fits in a
  /// `torch::nn::AnyModule` or a `Sequential` (e.g. between an embedding and
  /// a head).
  torch::Tensor forward(const torch::Tensor& input);
  /// Several tensors flowing between stages: the first layer receives
  /// `std::vector<torch::Tensor>`, and each stage's last layer returns a
  /// `torch::Tensor` or a `std::vector<torch::Tensor>`. Each value is cut
  /// along its entry of `PipeOptions::batch_dim` (dim 0 by default), and all
  /// cut values must have the same batch size there.
  std::vector<torch::Tensor> forward_tuple(std::vector<torch::Tensor> inputs);
  /// One tensor in (the first layer receives a `torch::Tensor`), every
  /// output back: for a last layer returning `std::vector<torch::Tensor>`.
  std::vector<torch::Tensor> forward_tuple(const torch::Tensor& input);

  /// `loss_fn(output, target)` of one micro-batch: a scalar loss,
  /// mean-reduced over the micro-batch's rows (e.g. `torch::mse_loss`).
  using LossFn = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;
  /// The same for several outputs and targets.
  using TupleLossFn = std::function<torch::Tensor(const std::vector<torch::Tensor>& outputs,
                                                  const std::vector<torch::Tensor>& targets)>;
  /// One training step inside the pipeline, in the order of
  /// `PipeOptions::schedule` (1F1B by default): forward, `loss_fn` and
  /// backward of every micro-batch. `target` is cut along dim 0 like the
  /// input; micro-batch i's loss counts rows_i / rows, so the returned loss
  /// (detached) equals `loss_fn(model(input), target)` and every `.grad`
  /// gains what `loss_fn(model(input), target).backward()` would add with
  /// the plain Sequential (zero the grads yourself, as before a backward).
  /// Checkpointing applies as in `forward` (in training mode). `loss_fn` runs on the last stage's worker. An
  /// error names the stage, the micro-batch and the phase ("forward",
  /// "loss", "backward", "input-grad backward", "weight-grad backward",
  /// "recompute"); the grads of a failed step are partial.
  torch::Tensor train_step(const torch::Tensor& input, const torch::Tensor& target,
                           const LossFn& loss_fn);
  /// Several input and target tensors (each cut along dim 0; the inputs
  /// along `PipeOptions::batch_dim`), several outputs.
  torch::Tensor train_step_tuple(std::vector<torch::Tensor> inputs,
                                 std::vector<torch::Tensor> targets, const TupleLossFn& loss_fn);

  /// Number of layers.
  size_t size() const noexcept;
  /// The layer at `index`, like `Sequential::ptr`.
  std::shared_ptr<torch::nn::Module> ptr(size_t index) const;
  /// The layer at `index`, like `Sequential::operator[]`.
  std::shared_ptr<torch::nn::Module> operator[](size_t index) const { return ptr(index); }
  /// The layer at `index` as its concrete type, like `Sequential::at`.
  template <typename T>
  T& at(size_t index) {
    return sequential_->at<T>(index);
  }
  /// The wrapped Sequential (its layers now live on the stages' devices).
  const torch::nn::Sequential& sequential() const noexcept { return sequential_; }

  /// Layers per stage.
  const std::vector<int64_t>& balance() const noexcept { return options_.balance(); }
  /// One device per worker (per stage unless `virtual_stages` > 1).
  const std::vector<c10::Device>& devices() const noexcept { return options_.devices(); }
  /// Micro-batches per mini-batch.
  int64_t chunks() const noexcept { return options_.chunks(); }
  /// Which micro-batches are checkpointed in training.
  Checkpoint checkpoint() const noexcept { return options_.checkpoint(); }
  /// The resolved options (balance and devices filled in).
  const PipeOptions& options() const noexcept { return options_; }
  /// The order `train_step` runs for `chunks` micro-batches, as a table in
  /// torch.distributed.pipelining's CSV format (see PipeOptions::schedule_csv).
  std::string schedule_csv();

  /// Switches tracing on or off: while on, every forward, backward,
  /// recompute and cross-device copy is recorded with its stage,
  /// micro-batch, start, end and thread. Off costs one relaxed atomic load
  /// per cell.
  void set_tracing(bool on);
  /// Whether tracing is on.
  bool tracing() const;
  /// What was recorded so far (a copy); `trace().summary()` gives the
  /// measured bubble, `trace().save_chrome_json(path)` a Chrome trace.
  Trace trace() const;
  /// Forgets what was recorded; the next forward is step 0 again.
  void clear_trace();

  /// Devices belong to the Pipe: moving it as a whole is refused. Casting
  /// (`to(torch::kFloat64)`) is fine.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;
  using torch::nn::Module::to;

  /// A deep copy, as torch's Cloneable gives: the layers cloned (their
  /// parameters and buffers copied, on the devices they live on now) in a
  /// new Pipe with these resolved options. A `device` is refused (the stages
  /// keep their devices), as are layers sharing a parameter (a clone would
  /// untie them) and layers that cannot be cloned, each naming the fix.
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<torch::Device>& device = std::nullopt) const override;

  void pretty_print(std::ostream& stream) const override;

 private:
  torch::nn::Sequential sequential_;
  PipeOptions options_;
  std::shared_ptr<detail::Engine> engine_;
};

/// A `ModuleHolder` for `PipeImpl`. See `PipeImpl` and `PipeOptions`.
TORCH_MODULE(Pipe);

}  // namespace gpipe
