// ranks.cpp — settings compared across ranks, tied parameters found, broadcast and their grads summed.
#include "ranks.h"

#include "check.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>
#include <utility>

namespace gpipe::detail {

namespace {

// Settings are names and printed values, never control characters.
constexpr char kField = '\x1f';
constexpr char kRecord = '\x1e';

std::string encode(const std::vector<Setting>& settings) {
  std::string text;
  for (const auto& s : settings) text += s.name + kField + s.value + kRecord;
  return text;
}

std::vector<Setting> decode(const std::string& text) {
  std::vector<Setting> settings;
  size_t at = 0;
  while (at < text.size()) {
    const size_t field = text.find(kField, at);
    const size_t record = text.find(kRecord, at);
    if (field == std::string::npos || record == std::string::npos || field > record) break;
    settings.push_back({text.substr(at, field - at), text.substr(field + 1, record - field - 1)});
    at = record + 1;
  }
  return settings;
}

// The sum over the group of a host tensor, all_reduced on `device`, back on the host.
// Every rank of the group makes these exchanges (at construction, at the start
// of each step): one that fails lost a rank. An all_reduce cannot say which, so
// the error says where this rank was and what to do; no C++ backtrace.
at::Tensor summed(c10d::ProcessGroup& group, c10::Device device, const at::Tensor& host,
                  std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) {
  std::vector<at::Tensor> tensors{host.to(device)};
  const auto started = std::chrono::steady_clock::now();
  try {
    auto work = group.allreduce(tensors);
    if (timeout.count() > 0) {
      work->wait(timeout);
    } else {
      work->wait();
    }
  } catch (const std::exception& e) {
    if (timeout.count() > 0 && std::chrono::steady_clock::now() - started >= timeout) {
      throw c10::Error(
          c10::str("gpipe: rank ", group.getRank(), " waited ", timeout.count() / 1000.0,
                   " s (the pipe's step_timeout) for the other ranks of the pipeline to start "
                   "the step (the exchange every rank makes first); one is stuck before it "
                   "(still in its previous step, its data, a collective of its own) or dead (",
                   e.what(), ")"),
          /*backtrace=*/nullptr);
    }
    throw c10::Error(
        c10::str("gpipe: rank ", group.getRank(), " of the pipeline's ", group.getSize(),
                 " ranks lost another in an exchange every rank makes (at construction, or "
                 "at the start of a step): a rank died, or did not answer within the "
                 "process group's timeout (", e.what(), "). Restart the job from its last "
                 "checkpoint (torchrun --max-restarts; docs/distributed.md, Restarts)"),
        /*backtrace=*/nullptr);
  }
  return tensors[0].to(at::kCPU);
}

// Every rank's text: rank r writes row r of a [ranks, longest] table of
// zeros, and the sum over the group is every row.
std::vector<std::string> gather(c10d::ProcessGroup& group, c10::Device device,
                                const std::string& mine) {
  const int64_t ranks = group.getSize();
  if (ranks == 1) return {mine};  // (a group of one may have no backend)
  const int64_t rank = group.getRank();
  const auto cpu = at::TensorOptions().dtype(at::kInt);
  at::Tensor lengths = at::zeros({ranks}, cpu);
  lengths.data_ptr<int32_t>()[rank] = static_cast<int32_t>(mine.size());
  lengths = summed(group, device, lengths);
  const int32_t* length = lengths.data_ptr<int32_t>();
  const int64_t longest = *std::max_element(length, length + ranks);
  at::Tensor table = at::zeros({ranks, std::max<int64_t>(longest, 1)}, cpu);
  int32_t* row = table.data_ptr<int32_t>() + rank * table.size(1);
  for (size_t k = 0; k < mine.size(); ++k) row[k] = static_cast<unsigned char>(mine[k]);
  table = summed(group, device, table);
  std::vector<std::string> texts;
  for (int64_t r = 0; r < ranks; ++r) {
    const int32_t* cells = table.data_ptr<int32_t>() + r * table.size(1);
    std::string text(static_cast<size_t>(length[r]), '\0');
    for (size_t k = 0; k < text.size(); ++k) text[k] = static_cast<char>(cells[k]);
    texts.push_back(std::move(text));
  }
  return texts;
}

// "rank 2", "ranks 0, 1 and 3".
std::string ranks_text(const std::vector<int64_t>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t k = 0; k < ranks.size(); ++k) {
    if (k > 0) text += k + 1 == ranks.size() ? " and " : ", ";
    text += std::to_string(ranks[k]);
  }
  return text;
}

std::string shortened(const std::string& value) {
  constexpr size_t kLongest = 160;
  return value.size() <= kLongest ? value : value.substr(0, kLongest) + "...";
}

}  // namespace

std::vector<StepStart> exchange_step_start(c10d::ProcessGroup& group, c10::Device device,
                                           const StepStart& mine, int64_t chunks,
                                           std::chrono::milliseconds timeout) {
  // Row r: error flag, then the input's count and rows, then the target's.
  const int64_t ranks = group.getSize();
  const int64_t width = 3 + 2 * chunks;
  at::Tensor table = at::zeros({ranks, width}, at::TensorOptions().dtype(at::kLong));
  int64_t* row = table.data_ptr<int64_t>() + group.getRank() * width;
  row[0] = mine.error.empty() ? 0 : 1;
  auto put = [&](int64_t at, const std::vector<int64_t>& rows) {
    const auto n = std::min<int64_t>(static_cast<int64_t>(rows.size()), chunks);
    row[at] = n;
    for (int64_t k = 0; k < n; ++k) row[at + 1 + k] = rows[static_cast<size_t>(k)];
  };
  put(1, mine.input_rows);
  put(2 + chunks, mine.target_rows);
  if (ranks > 1) table = summed(group, device, table, timeout);
  std::vector<StepStart> all(static_cast<size_t>(ranks));
  bool any_error = false;
  for (int64_t r = 0; r < ranks; ++r) {
    const int64_t* cells = table.data_ptr<int64_t>() + r * width;
    auto rows = [&](int64_t at) {
      return std::vector<int64_t>(cells + at + 1, cells + at + 1 + cells[at]);
    };
    all[static_cast<size_t>(r)].input_rows = rows(1);
    all[static_cast<size_t>(r)].target_rows = rows(2 + chunks);
    any_error |= cells[0] != 0;
  }
  if (any_error) {
    const auto texts = gather(group, device, mine.error);
    for (size_t r = 0; r < all.size(); ++r) all[r].error = texts[r];
  }
  return all;
}

void check_agreement(c10d::ProcessGroup& group, c10::Device device,
                     const std::vector<Setting>& settings, const std::string& what) {
  const auto texts = gather(group, device, encode(settings));
  // Setting -> value -> ranks, settings in the order the ranks name them.
  std::vector<std::string> order;
  std::map<std::string, std::map<std::string, std::vector<int64_t>>> values;
  const std::string missing = "(nothing)";
  std::vector<std::vector<Setting>> all;
  for (const auto& text : texts) {
    all.push_back(decode(text));
    for (const auto& s : all.back()) {
      if (!values.count(s.name)) order.push_back(s.name);
      values[s.name];
    }
  }
  for (size_t r = 0; r < all.size(); ++r) {
    std::map<std::string, std::string> own;
    for (const auto& s : all[r]) own.emplace(s.name, s.value);
    for (const auto& name : order) {
      auto it = own.find(name);
      values[name][it == own.end() ? missing : it->second].push_back(static_cast<int64_t>(r));
    }
  }
  std::vector<std::string> lines;
  for (const auto& name : order) {
    const auto& by_value = values[name];
    if (by_value.size() <= 1) continue;
    // In rank order: the value of the lowest rank first.
    std::vector<std::pair<std::vector<int64_t>, std::string>> groups;
    for (const auto& [value, ranks] : by_value) groups.emplace_back(ranks, value);
    std::sort(groups.begin(), groups.end());
    std::string line = "  " + name + ": ";
    for (size_t k = 0; k < groups.size(); ++k) {
      if (k > 0) line += "; ";
      line += ranks_text(groups[k].first) + (groups[k].first.size() == 1 ? " has " : " have ") +
              shortened(groups[k].second);
    }
    lines.push_back(std::move(line));
  }
  if (lines.empty()) return;
  constexpr size_t kShown = 8;
  std::string message = c10::str("the ranks of this ", what, " disagree on ",
                                 count(static_cast<int64_t>(lines.size()), "setting"),
                                 "; every rank must build the same model and pass the same "
                                 "arguments:");
  for (size_t k = 0; k < lines.size() && k < kShown; ++k) message += "\n" + lines[k];
  if (lines.size() > kShown) message += c10::str("\n  and ", lines.size() - kShown, " more");
  throw_value_error(message);
}

std::vector<Setting> parameter_settings(const LayerParameters& layers) {
  std::vector<Setting> settings;
  for (size_t k = 0; k < layers.size(); ++k) {
    std::ostringstream value;
    if (layers[k].empty()) value << "none";
    for (size_t p = 0; p < layers[k].size(); ++p) {
      const auto& [name, t] = layers[k][p];
      value << (p == 0 ? "" : ", ") << name;
      if (!t.defined()) {
        value << " None";
        continue;
      }
      value << " " << t.sizes() << " " << t.scalar_type() << (t.requires_grad() ? "" : " frozen");
    }
    settings.push_back({"layer " + std::to_string(k), value.str()});
  }
  return settings;
}

std::vector<Tie> find_ties(const LayerParameters& layers, const std::vector<std::string>& names,
                           const std::vector<int64_t>& rank_of_layer, int64_t rank) {
  struct Uses {
    std::vector<std::string> names;
    std::set<int64_t> ranks;
    at::Tensor tensor;
    bool here = false;
  };
  std::vector<const c10::TensorImpl*> order;
  std::unordered_map<const c10::TensorImpl*, Uses> uses;
  for (size_t k = 0; k < layers.size(); ++k) {
    for (const auto& [name, t] : layers[k]) {
      if (!t.defined()) continue;
      auto [it, fresh] = uses.try_emplace(t.unsafeGetTensorImpl());
      if (fresh) order.push_back(t.unsafeGetTensorImpl());
      Uses& u = it->second;
      const std::string full = names[k] + "." + name;
      // A layer may hold one tensor under two names; a use is a layer.
      if (std::find(u.names.begin(), u.names.end(), full) == u.names.end()) u.names.push_back(full);
      u.ranks.insert(rank_of_layer[k]);
      u.tensor = t;
      u.here |= rank_of_layer[k] == rank;
    }
  }
  std::vector<Tie> ties;
  for (const auto* impl : order) {
    const Uses& u = uses.at(impl);
    if (u.ranks.size() < 2) continue;
    Tie tie;
    tie.uses = u.names;
    tie.owners.assign(u.ranks.begin(), u.ranks.end());
    if (u.here) tie.replica = u.tensor;
    tie.sizes = u.tensor.sizes().vec();
    tie.dtype = u.tensor.scalar_type();
    tie.requires_grad = u.tensor.requires_grad();
    ties.push_back(std::move(tie));
  }
  return ties;
}

Setting ties_setting(const std::vector<Tie>& ties) {
  std::string value;
  for (const auto& tie : ties) {
    if (!value.empty()) value += "; ";
    for (size_t k = 0; k < tie.uses.size(); ++k) value += (k > 0 ? " = " : "") + tie.uses[k];
  }
  return {"tied parameters", value.empty() ? "none" : value};
}

TiedParameters::TiedParameters(std::vector<Tie> ties, c10d::ProcessGroup& pipeline,
                               c10::Device wire)
    : ties_(std::move(ties)), pipeline_(pipeline), wire_(wire), rank_(pipeline.getRank()) {
  for (const auto& tie : ties_) {
    TORCH_INTERNAL_ASSERT(!tie.owners.empty() &&
                              (!tie.owners_only || !tie.replica.defined() || tie.group),
                          "an owner of a tie summed over the owners' group has no such group");
  }
}

at::Tensor TiedParameters::sum(const Tie& tie, const at::Tensor& mine) {
  at::Tensor buffer;
  if (mine.defined()) {
    buffer = at::empty(tie.sizes, at::TensorOptions().dtype(tie.dtype).device(wire_));
    buffer.copy_(mine);
  } else {
    buffer = at::zeros(tie.sizes, at::TensorOptions().dtype(tie.dtype).device(wire_));
  }
  std::vector<at::Tensor> tensors{buffer};
  (tie.owners_only ? *tie.group : pipeline_).allreduce(tensors)->wait();
  return tensors[0];
}

void TiedParameters::broadcast() {
  at::NoGradGuard no_grad;
  for (const auto& tie : ties_) {
    if (tie.owners_only && !tie.replica.defined()) continue;  // not in the owners' group
    // The lowest owner's values plus zeros: every replica, the lowest
    // owner's included, takes the same bytes.
    const bool lowest = rank_ == tie.owners.front();
    at::Tensor values = sum(tie, lowest ? tie.replica : at::Tensor());
    if (tie.replica.defined()) tie.replica.copy_(values);
  }
}

void TiedParameters::set_replicas(const std::vector<at::Tensor>& replicas) {
  TORCH_CHECK(replicas.size() == ties_.size(), "gpipe: set_tie_replicas got ", replicas.size(),
              " tensors for ", ties_.size(), " tied parameters (one per tie, in order)");
  for (size_t k = 0; k < ties_.size(); ++k) {
    const auto& replica = replicas[k];
    if (!replica.defined()) continue;
    auto& tie = ties_[k];
    TORCH_CHECK(tie.replica.defined(), "gpipe: this rank holds no use of the tied parameter ",
                tie.uses.front(), ", so it keeps no replica to replace");
    TORCH_CHECK(replica.sizes() == at::IntArrayRef(tie.sizes), "gpipe: the replica of ",
                tie.uses.front(), " must have its sizes ", at::IntArrayRef(tie.sizes), ", got ",
                replica.sizes());
    tie.replica = replica;
  }
}

void TiedParameters::begin_step() {
  aside_.assign(ties_.size(), at::Tensor());
  for (size_t k = 0; k < ties_.size(); ++k) {
    auto& replica = ties_[k].replica;
    if (!replica.defined() || !replica.grad().defined()) continue;
    aside_[k] = replica.grad();
    replica.mutable_grad() = at::Tensor();
  }
}

namespace {

// `grad` plus what was put aside, in the put-aside tensor (the one the
// caller's optimizer may hold).
at::Tensor with_aside(at::Tensor aside, const at::Tensor& grad) {
  if (!aside.defined()) return grad;
  if (grad.defined()) aside.add_(grad);
  return aside;
}

}  // namespace

void TiedParameters::reduce_grads() {
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < ties_.size(); ++k) {
    const auto& tie = ties_[k];
    if (!tie.requires_grad) continue;
    if (tie.owners_only && !tie.replica.defined()) continue;
    const at::Tensor grad = tie.replica.defined() ? tie.replica.grad() : at::Tensor();
    at::Tensor total = sum(tie, grad);
    if (!tie.replica.defined()) continue;
    if (grad.defined()) {
      grad.copy_(total);
      total = grad;
    } else {
      total = total.to(tie.replica.device());
    }
    at::Tensor aside = k < aside_.size() ? std::exchange(aside_[k], at::Tensor()) : at::Tensor();
    tie.replica.mutable_grad() = with_aside(std::move(aside), total);
  }
  aside_.clear();
}

void TiedParameters::restore_grads() {
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < aside_.size(); ++k) {
    auto& replica = ties_[k].replica;
    if (aside_[k].defined()) replica.mutable_grad() = with_aside(aside_[k], replica.grad());
  }
  aside_.clear();
}

}  // namespace gpipe::detail
