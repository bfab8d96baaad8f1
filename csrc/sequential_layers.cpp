// sequential_layers.cpp — SequentialLayers (a stage's layers in order, skips through a tracker) and the skip routes between stages.
#include "sequential_layers.h"

#include "check.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace gpipe::detail {

SequentialLayers::SequentialLayers(std::vector<torch::nn::AnyModule> modules, int64_t first_index,
                                   std::vector<SkipKey> arriving, std::vector<SkipKey> leaving)
    : modules_(std::move(modules)),
      first_index_(first_index),
      arriving_(std::move(arriving)),
      leaving_(std::move(leaving)) {
  for (const auto& m : modules_) {
    skippables_.push_back(dynamic_cast<const Skippable*>(m.ptr().get()));
    any_skippable_ = any_skippable_ || skippables_.back() != nullptr;
  }
}

std::vector<bool> SequentialLayers::training_flags() const {
  std::vector<bool> flags;
  for (const auto& layer : modules_) {
    for (const auto& module : layer.ptr()->modules()) flags.push_back(module->is_training());
  }
  return flags;
}

Batch SequentialLayers::forward(const Batch& input) {
  if (!any_skippable_) return run(input);
  SkipTracker tracker;
  const size_t main = input.size() - arriving_.size();
  for (size_t k = 0; k < arriving_.size(); ++k) tracker.save(arriving_[k], input[main + k]);
  UseSkipTracker use(tracker);
  Batch out = run(Batch(std::vector<at::Tensor>(
                            input.values.begin(),
                            input.values.begin() + static_cast<std::ptrdiff_t>(main)),
                        input.atomic),
                  &tracker);
  for (const auto& key : leaving_) {
    TORCH_INTERNAL_ASSERT(tracker.contains(key), "skip '", key.name, "' was not stashed");
    out.values.push_back(tracker.load(key));
  }
  TORCH_INTERNAL_ASSERT(tracker.size() == 0, "a skip stayed in its stage unpopped");
  return out;
}

Batch SequentialLayers::run(const Batch& input, SkipTracker* tracker) {
  torch::nn::AnyValue value =
      input.atomic ? modules_[0].any_forward(input[0]) : modules_[0].any_forward(input.values);
  if (tracker != nullptr) check(0, *tracker);
  for (size_t n = 1; n < modules_.size(); ++n) {
    value = modules_[n].any_forward(std::move(value));
    if (tracker != nullptr) check(n, *tracker);
  }
  if (auto* t = value.try_get<torch::Tensor>()) return Batch(*t);
  if (auto* ts = value.try_get<std::vector<torch::Tensor>>()) return Batch(*ts, false);
  TORCH_CHECK(false, "layer ", first_index_ + static_cast<int64_t>(modules_.size()) - 1,
              " ends a stage but returned a value of type ", value.type_info().name(),
              "; a stage's last layer must return torch::Tensor or std::vector<torch::Tensor>");
}

// verify_skippables paired the declarations; this checks the forward kept them.
void SequentialLayers::check(size_t n, const SkipTracker& tracker) const {
  const Skippable* layer = skippables_[n];
  if (layer == nullptr) return;
  const int64_t index = first_index_ + static_cast<int64_t>(n);
  for (const auto& name : layer->stash_names()) {
    TORCH_CHECK(tracker.contains(layer->key(name)), "layer ", index, " (",
                short_name(modules_[n].ptr()->name()), ") declares that it stashes '", name,
                "' but its forward did not stash it; call stash(\"", name,
                "\", tensor) in forward, or drop the name from its SkipNames");
  }
  for (const auto& name : layer->pop_names()) {
    TORCH_CHECK(!tracker.contains(layer->key(name)), "layer ", index, " (",
                short_name(modules_[n].ptr()->name()), ") declares that it pops '", name,
                "' but its forward did not pop it; call pop(\"", name,
                "\") in forward, or drop the name from its SkipNames");
  }
}

SkipLayout skip_layout(const torch::nn::Sequential& sequential,
                       const std::vector<int64_t>& balance) {
  const size_t stages = balance.size();
  std::vector<int64_t> stage_of;
  for (size_t j = 0; j < stages; ++j) {
    stage_of.insert(stage_of.end(), static_cast<size_t>(balance[j]), static_cast<int64_t>(j));
  }
  std::vector<SkipRouteInfo> crossing;
  for (auto& info : verify_skippables(sequential)) {
    if (stage_of[info.stash_layer] != stage_of[info.pop_layer]) crossing.push_back(info);
  }
  std::stable_sort(crossing.begin(), crossing.end(), [&](const auto& a, const auto& b) {
    return std::pair(stage_of[a.pop_layer], stage_of[a.stash_layer]) <
           std::pair(stage_of[b.pop_layer], stage_of[b.stash_layer]);
  });
  SkipLayout layout;
  layout.arriving.resize(stages);
  layout.leaving.resize(stages);
  for (const auto& info : crossing) {
    const int64_t from = stage_of[info.stash_layer];
    const int64_t to = stage_of[info.pop_layer];
    layout.routes.push_back(SkipRoute{from, to});
    layout.leaving[static_cast<size_t>(from)].push_back(info.key);
    layout.arriving[static_cast<size_t>(to)].push_back(info.key);
  }
  return layout;
}

}  // namespace gpipe::detail
