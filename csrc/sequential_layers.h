// sequential_layers.h — a stage's slice of a torch::nn::Sequential, run as Sequential::forward runs it, with the skips it takes and gives.
#pragma once

#include "stage.h"
#include "transport.h"

#include <gpipe/skip.h>

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <vector>

namespace gpipe::detail {

/// One stage's slice of the Sequential, run like Sequential::forward runs it
/// (a tensor, or a tuple as std::vector<torch::Tensor>, between layers).
/// With skips, the input holds the main values and then one per skip
/// arriving here, and the output the main values and then one per skip
/// leaving (see SkipRoute); the layers stash and pop through a tracker of
/// this call's own. Used by gpipe::Pipe and gpipe::DistributedPipe alike.
class SequentialLayers : public Layers {
 public:
  /// `modules` are layers `first_index`, `first_index + 1`, ... of the
  /// Sequential (for errors); `arriving` and `leaving`: this stage's skips
  /// in route order (see SkipLayout).
  SequentialLayers(std::vector<torch::nn::AnyModule> modules, int64_t first_index,
                   std::vector<SkipKey> arriving = {}, std::vector<SkipKey> leaving = {});

  Batch forward(const Batch& input) override;
  std::vector<bool> training_flags() const override;

 private:
  Batch run(const Batch& input, SkipTracker* tracker = nullptr);
  /// A Skippable layer stashed and popped all it declares.
  void check(size_t n, const SkipTracker& tracker) const;

  std::vector<torch::nn::AnyModule> modules_;
  int64_t first_index_;
  std::vector<SkipKey> arriving_;
  std::vector<SkipKey> leaving_;
  std::vector<const Skippable*> skippables_;
  bool any_skippable_ = false;
};

/// The skips of a Sequential cut into stages: those crossing stages become
/// routes, ordered by (popping stage, stashing stage, stashing layer); each
/// stage's layers take the arriving ones and give the leaving ones in that
/// order. Computed over the whole Sequential, so every rank of a
/// distributed pipeline derives the same routes.
struct SkipLayout {
  std::vector<SkipRoute> routes;
  /// Per stage: the keys of the routes arriving there, and leaving.
  std::vector<std::vector<SkipKey>> arriving;
  std::vector<std::vector<SkipKey>> leaving;
};
/// Checks the Skippable layers' pairing (verify_skippables) and lays their
/// skips out over the stages `balance` (layers per stage, summing to the
/// Sequential's length) makes.
SkipLayout skip_layout(const torch::nn::Sequential& sequential,
                       const std::vector<int64_t>& balance);

}  // namespace gpipe::detail
