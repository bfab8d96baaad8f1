// distributed_pipe.cpp — DistributedPipeImpl: checks the options, keeps this rank's layers, runs the engine over the group.
#include <gpipe/distributed_pipe.h>

#include "check.h"
#include "engine.h"
#include "sequential_layers.h"
#include "stage.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <ATen/ops/cat.h>

#include <algorithm>
#include <iterator>
#include <numeric>
#include <string>

namespace gpipe {

DistributedPipeImpl::DistributedPipeImpl(torch::nn::Sequential sequential,
                                         DistributedPipeOptions options)
    : options_(std::move(options)) {
  const auto& group = options_.group();
  GPIPE_CHECK_VALUE(group, "DistributedPipeOptions has no group; pass .group(process_group) "
                    "(gpipe::distributed::init_process_group(), or c10d::resolve_process_group(name))");
  const int64_t ranks = group->getSize();
  rank_ = group->getRank();
  int64_t v = options_.virtual_stages();
  GPIPE_CHECK_VALUE(v >= 1, "virtual_stages must be at least 1, got ", v);
  auto layout = detail::stage_layout(options_.schedule_csv(), options_.schedule(), v, "rank");
  auto& table = layout.table;
  v = layout.virtual_stages;
  options_.virtual_stages(v);
  // ZB-V runs two stages per rank in a V (rank r holds stages r and 2R-1-r).
  const auto rank_of_stage = detail::placement_of(layout.kind, ranks, v);
  const auto& balance = options_.balance();
  const int64_t stages = ranks * v;
  GPIPE_CHECK_VALUE(static_cast<int64_t>(balance.size()) == stages, "balance has ",
                    balance.size(), " stages but the group has ", ranks, " ranks x "
                    "virtual_stages ", v, " = ", stages, " stages; pass ", stages, " entries");
  for (int64_t n : balance) {
    GPIPE_CHECK_VALUE(n > 0, "every balance entry must be positive, got ", n);
  }
  const int64_t total = std::accumulate(balance.begin(), balance.end(), int64_t{0});
  GPIPE_CHECK_VALUE(total == static_cast<int64_t>(sequential->size()), "balance sums to ", total,
                    " but the Sequential has ", sequential->size(),
                    " layers; pass one entry per stage summing to ", sequential->size());
  GPIPE_CHECK_VALUE(options_.chunks() >= 1, "chunks must be at least 1, got ", options_.chunks());

  // Every rank lays out the skips of the whole Sequential, so all agree on
  // the routes; its stages take and give those of their own.
  auto skips = detail::skip_layout(sequential, balance);
  std::vector<int64_t> starts(static_cast<size_t>(stages), 0);
  for (int64_t s = 1; s < stages; ++s) starts[s] = starts[s - 1] + balance[s - 1];
  const auto children = sequential->named_children();
  std::vector<std::unique_ptr<detail::Layers>> parts;
  for (int64_t s = 0; s < stages; ++s) {
    if (rank_of_stage[static_cast<size_t>(s)] != rank_) continue;
    stages_.push_back(s);
    std::vector<torch::nn::AnyModule> layers;
    for (int64_t k = starts[s]; k < starts[s] + balance[s]; ++k) {
      const auto& any = *std::next(sequential->begin(), k);
      const auto layer = any.ptr();
      layer->to(options_.device());
      register_module(children[static_cast<size_t>(k)].key(), layer);
      layers.push_back(any);
    }
    parts.push_back(std::make_unique<detail::SequentialLayers>(
        std::move(layers), starts[s], std::move(skips.arriving[static_cast<size_t>(s)]),
        std::move(skips.leaving[static_cast<size_t>(s)])));
  }
  is_first_ = stages_.front() == 0;
  is_last_ = stages_.back() == stages - 1;
  engine_ = std::make_shared<detail::Engine>(
      std::move(parts), std::vector<c10::Device>(static_cast<size_t>(v), options_.device()),
      options_.chunks(), options_.checkpoint(), /*intra_op_threads=*/-1, v,
      // A table replaces the named schedule (set_plan below).
      layout.kind,
      detail::Groups{group, options_.reverse_group(), options_.dp_group()});
  engine_->set_skip_routes(std::move(skips.routes));
  engine_->set_batch_dims(options_.batch_dim(), options_.output_batch_dim());
  GPIPE_CHECK_VALUE(options_.step_timeout().count() >= 0, "step_timeout must not be negative, got ",
                    options_.step_timeout().count(),
                    " ms; pass 0 (the default) for the process group's own timeout");
  engine_->set_step_timeout(options_.step_timeout());

  // What every rank must share, compared once; then the tied parameters.
  detail::LayerParameters parameters;
  std::vector<std::string> names;
  std::vector<int64_t> rank_of_layer;
  for (int64_t s = 0; s < stages; ++s) {
    for (int64_t k = starts[s]; k < starts[s] + balance[s]; ++k) {
      const auto& child = children[static_cast<size_t>(k)];
      std::vector<std::pair<std::string, at::Tensor>> own;
      for (const auto& p : child.value()->named_parameters()) own.emplace_back(p.key(), p.value());
      parameters.push_back(std::move(own));
      names.push_back(child.key());
      rank_of_layer.push_back(rank_of_stage[static_cast<size_t>(s)]);
    }
  }
  auto ties = detail::find_ties(parameters, names, rank_of_layer, rank_);
  std::vector<detail::Setting> settings{
      {"balance", detail::listed(balance)},
      {"chunks", std::to_string(options_.chunks())},
      {"schedule", table ? options_.schedule_csv() : to_string(options_.schedule())},
      {"virtual_stages", std::to_string(v)},
      {"checkpoint", options_.stage_checkpoints().empty()
                         ? to_string(options_.checkpoint())
                         : detail::listed(options_.stage_checkpoints())},
      {"batch_dim", detail::listed(options_.batch_dim())},
      {"output_batch_dim", detail::listed(options_.output_batch_dim())},
      detail::ties_setting(ties)};
  auto layers = detail::parameter_settings(parameters);
  settings.insert(settings.end(), layers.begin(), layers.end());
  engine_->check_agreement(settings, "DistributedPipe");
  // After the ranks agreed on it: it fits on every rank or on none.
  if (table) engine_->set_plan(std::move(*table));
  if (!options_.stage_checkpoints().empty()) {
    engine_->set_stage_checkpoints(options_.stage_checkpoints());
  }
  engine_->set_ties(std::move(ties));
  if (options_.dp_group()) {
    GPIPE_CHECK_VALUE(options_.bucket_cap_mb() > 0, "bucket_cap_mb must be positive, got ",
                      options_.bucket_cap_mb(), "; the default is 25");
    engine_->set_bucket_cap(std::max<int64_t>(
        1, static_cast<int64_t>(options_.bucket_cap_mb() * static_cast<double>(1 << 20))));
  }
}

DistributedPipeImpl::~DistributedPipeImpl() = default;

std::string DistributedPipeImpl::schedule_csv() {
  return detail::plan_to_csv(engine_->plan(options_.chunks()));
}

torch::Tensor DistributedPipeImpl::run_train_step(detail::Batch input, detail::Batch target,
                                                  const detail::LossFn& fn, const char* name) {
  if (is_first_ && input.values.empty()) {
    const std::string what = "rank " + std::to_string(rank_) + " holds stage 0, so " + name +
                             " needs the input here";
    engine_->abandon_step(what, /*training_step=*/true);
    detail::throw_value_error(what);
  }
  if (is_last_ && target.values.empty()) {
    const std::string what = "rank " + std::to_string(rank_) + " holds the last stage, so " +
                             name + " needs the target here";
    engine_->abandon_step(what, /*training_step=*/true);
    detail::throw_value_error(what);
  }
  return engine_->train_step(is_first_ ? std::move(input) : detail::Batch(),
                             is_last_ ? std::move(target) : detail::Batch(), fn, is_training());
}

torch::Tensor DistributedPipeImpl::train_step(const torch::Tensor& input,
                                              const torch::Tensor& target, const LossFn& loss_fn) {
  const detail::LossFn fn = [&](const detail::Batch& out, const detail::Batch& t) {
    GPIPE_CHECK_VALUE(out.atomic && out.size() == 1, "the last stage's last layer returned ",
                      out.size(), " tensors; call train_step_tuple to get them all");
    return loss_fn(out[0], t[0]);
  };
  auto batch = [](const torch::Tensor& t) { return t.defined() ? detail::Batch(t) : detail::Batch(); };
  torch::Tensor loss = run_train_step(batch(input), batch(target), fn, "train_step");
  return loss;
}

torch::Tensor DistributedPipeImpl::train_step_tuple(std::vector<torch::Tensor> inputs,
                                                    std::vector<torch::Tensor> targets,
                                                    const TupleLossFn& loss_fn) {
  const detail::LossFn fn = [&](const detail::Batch& out, const detail::Batch& t) {
    return loss_fn(out.values, t.values);
  };
  auto batch = [](std::vector<torch::Tensor> ts) {
    return ts.empty() ? detail::Batch() : detail::Batch(std::move(ts), /*is_atomic=*/false);
  };
  torch::Tensor loss =
      run_train_step(batch(std::move(inputs)), batch(std::move(targets)), fn, "train_step_tuple");
  return loss;
}

torch::Tensor DistributedPipeImpl::eval_step(const torch::Tensor& input) {
  at::NoGradGuard no_grad;
  detail::Batch out = engine_->eval_step(is_first_ && input.defined() ? detail::Batch(input)
                                                                      : detail::Batch());
  if (out.values.empty()) return torch::Tensor();
  GPIPE_CHECK_VALUE(out.atomic && out.size() == 1, "the last stage's last layer returned ",
                    out.size(), " tensors; call eval_step_tuple to get them all");
  return out[0];
}

std::vector<torch::Tensor> DistributedPipeImpl::eval_step_tuple(std::vector<torch::Tensor> inputs) {
  at::NoGradGuard no_grad;
  detail::Batch out = engine_->eval_step(is_first_ && !inputs.empty()
                                             ? detail::Batch(std::move(inputs), /*is_atomic=*/false)
                                             : detail::Batch());
  return out.values;
}

}  // namespace gpipe
