// skip.cpp — the skip API: namespaces, the per-thread tracker, stash and pop, the pairing check.
#include <gpipe/skip.h>

#include "check.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <set>
#include <sstream>

namespace gpipe {

namespace {

// Namespace 0 is the default one; each Namespace() takes the next number.
std::atomic<uint64_t> next_namespace{1};

// The tracker a UseSkipTracker installed on this thread, if any.
thread_local SkipTracker* installed = nullptr;

bool contains(const std::vector<std::string>& names, const std::string& name) {
  for (const auto& n : names) {
    if (n == name) return true;
  }
  return false;
}

std::string quoted(const std::vector<std::string>& names) {
  std::ostringstream out;
  out << "{";
  for (size_t k = 0; k < names.size(); ++k) out << (k ? ", " : "") << "\"" << names[k] << "\"";
  out << "}";
  return out.str();
}

}  // namespace

Namespace::Namespace() : id_(next_namespace.fetch_add(1)) {}

void SkipTracker::save(const SkipKey& key, at::Tensor tensor) {
  tensors_[key] = std::move(tensor);
}

at::Tensor SkipTracker::load(const SkipKey& key) {
  auto it = tensors_.find(key);
  TORCH_CHECK(it != tensors_.end(), "skip '", key.name,
              "' has not been stashed: the layer that stashes it must run before the one that "
              "pops it");
  at::Tensor tensor = std::move(it->second);
  tensors_.erase(it);
  return tensor;
}

SkipTracker& current_skip_tracker() {
  thread_local SkipTracker own;
  return installed != nullptr ? *installed : own;
}

UseSkipTracker::UseSkipTracker(SkipTracker& tracker) : previous_(installed) {
  installed = &tracker;
}

UseSkipTracker::~UseSkipTracker() { installed = previous_; }

Skippable::Skippable(SkipNames names) : names_(std::move(names)) {}

Skippable& Skippable::isolate(const Namespace& ns, const std::vector<std::string>& only) {
  for (const auto& name : only) {
    GPIPE_CHECK_VALUE(contains(names_.stash, name) || contains(names_.pop, name), who(),
                      " has no skip named '", name, "' to isolate; it stashes ",
                      quoted(names_.stash), " and pops ", quoted(names_.pop));
  }
  auto put = [&](const std::vector<std::string>& names) {
    for (const auto& name : names) {
      if (only.empty() || contains(only, name)) namespaces_[name] = ns.id();
    }
  };
  put(names_.stash);
  put(names_.pop);
  return *this;
}

SkipKey Skippable::key(const std::string& name) const {
  auto it = namespaces_.find(name);
  return SkipKey{it == namespaces_.end() ? 0 : it->second, name};
}

void Skippable::stash(const std::string& name, at::Tensor tensor) {
  TORCH_CHECK(contains(names_.stash, name), who(), " stashed '", name,
              "' but does not declare it; declare it in gpipe::Skippable({.stash = {\"", name,
              "\"}}) (it declares ", quoted(names_.stash), ")");
  current_skip_tracker().save(key(name), std::move(tensor));
}

at::Tensor Skippable::pop(const std::string& name) {
  TORCH_CHECK(contains(names_.pop, name), who(), " popped '", name,
              "' but does not declare it; declare it in gpipe::Skippable({.pop = {\"", name,
              "\"}}) (it declares ", quoted(names_.pop), ")");
  auto& tracker = current_skip_tracker();
  TORCH_CHECK(tracker.contains(key(name)), who(), " popped '", name,
              "' but no layer before it stashed it; stash it in an earlier layer");
  return tracker.load(key(name));
}

std::string Skippable::who() const {
  const auto* module = dynamic_cast<const torch::nn::Module*>(this);
  return "layer " + (module != nullptr ? detail::short_name(module->name()) : std::string("?"));
}

std::vector<SkipRouteInfo> verify_skippables(const torch::nn::Sequential& sequential) {
  std::vector<std::string> problems;
  std::map<SkipKey, int64_t> stashed;  // key -> stashing layer
  std::set<SkipKey> popped;
  std::vector<SkipRouteInfo> routes;
  const auto layers = static_cast<int64_t>(sequential->size());
  auto name_of = [&](int64_t i) {
    return "layer " + std::to_string(i) + " (" +
           detail::short_name(sequential->ptr(static_cast<size_t>(i))->name()) + ")";
  };
  for (int64_t i = 0; i < layers; ++i) {
    const auto* skippable =
        dynamic_cast<const Skippable*>(sequential->ptr(static_cast<size_t>(i)).get());
    if (skippable == nullptr) continue;
    for (const auto& name : skippable->stash_names()) {
      if (contains(skippable->pop_names(), name)) {
        problems.push_back(name_of(i) + " declares '" + name +
                           "' both to stash and to pop; a layer keeps its own tensors without a "
                           "skip: drop it from one list");
        continue;
      }
      const SkipKey key = skippable->key(name);
      auto [it, fresh] = stashed.try_emplace(key, i);
      if (!fresh) {
        problems.push_back(name_of(i) + " stashes '" + name + "' which " + name_of(it->second) +
                           " stashes already; isolate each pair in its own gpipe::Namespace "
                           "(layer->isolate(ns)) or rename one");
      }
    }
    for (const auto& name : skippable->pop_names()) {
      if (contains(skippable->stash_names(), name)) continue;  // reported above
      const SkipKey key = skippable->key(name);
      auto it = stashed.find(key);
      if (it == stashed.end()) {
        problems.push_back(name_of(i) + " pops '" + name +
                           "' but no layer before it stashes it (in its namespace); stash it in "
                           "an earlier layer");
        continue;
      }
      if (!popped.insert(key).second) {
        problems.push_back(name_of(i) + " pops '" + name +
                           "' which a layer before it pops already; isolate each pair in its own "
                           "gpipe::Namespace (layer->isolate(ns)) or rename one");
        continue;
      }
      routes.push_back(SkipRouteInfo{key, it->second, i});
    }
  }
  for (const auto& [key, layer] : stashed) {
    if (popped.count(key) == 0) {
      problems.push_back(name_of(layer) + " stashes '" + key.name +
                         "' but no later layer pops it; pop it in a later layer or stop "
                         "stashing it");
    }
  }
  if (!problems.empty()) {
    std::ostringstream out;
    out << "the Sequential's skips do not pair up (each name is stashed by one layer and popped "
           "by one later layer):";
    for (const auto& p : problems) out << "\n* " << p;
    detail::throw_value_error(out.str());
  }
  std::stable_sort(routes.begin(), routes.end(), [](const auto& a, const auto& b) {
    return a.stash_layer < b.stash_layer;
  });
  return routes;
}

}  // namespace gpipe
