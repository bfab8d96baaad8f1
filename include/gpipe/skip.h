// skip.h — skip connections: a layer stashes a tensor under a name, a later layer pops it.
//
// Real models are not chains: a U-Net's encoder hands each resolution to the
// decoder, a residual block adds its input back. A layer that takes part
// derives from `gpipe::Skippable` next to `torch::nn::Module`, declares the
// names it stashes and pops, and calls `stash` / `pop` in its forward:
//
//   struct DownImpl : torch::nn::Module, gpipe::Skippable {
//     DownImpl() : gpipe::Skippable({.stash = {"down"}}) {
//       conv = register_module("conv", torch::nn::Conv2d(8, 8, 3));
//     }
//     torch::Tensor forward(torch::Tensor x) {
//       stash("down", x);          // taken by the layer that pops "down"
//       return conv(x);
//     }
//     torch::nn::Conv2d conv{nullptr};
//   };
//   TORCH_MODULE(Down);
//
//   struct UpImpl : torch::nn::Module, gpipe::Skippable {
//     UpImpl() : gpipe::Skippable({.pop = {"down"}}) {}
//     torch::Tensor forward(torch::Tensor x) { return x + pop("down"); }
//   };
//   TORCH_MODULE(Up);
//
// The same layers run in a plain torch::nn::Sequential (the stashed tensor
// waits in the thread's SkipTracker until popped) and in a gpipe::Pipe,
// which sends it straight from the stashing stage to the popping one (not
// through the stages between) and its grad straight back. Every name is
// stashed by one layer and popped by one later layer; to use a name twice,
// isolate each pair in its own Namespace (`isolate`). The Pipe checks this
// when it is built (`verify_skippables`).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace gpipe {

/// Keeps skip names apart: two layers stashing "skip" in different
/// namespaces stash two different skips. Copies compare equal.
class Namespace {
 public:
  Namespace();
  /// The same namespace (a copy of it).
  bool operator==(const Namespace& other) const noexcept { return id_ == other.id_; }
  /// An arbitrary but fixed order, for sorted containers.
  bool operator<(const Namespace& other) const noexcept { return id_ < other.id_; }
  /// Its number (0 is the default namespace, which no Namespace() takes).
  uint64_t id() const noexcept { return id_; }

 private:
  friend class Skippable;
  explicit Namespace(uint64_t id) : id_(id) {}
  uint64_t id_;
};

/// A skip's full name: its namespace (0: the default one) and its name.
struct SkipKey {
  /// The namespace's id (0: the default one).
  uint64_t ns = 0;
  /// The name the layers stash and pop it by.
  std::string name;
  // Written out, not a defaulted operator<=>: the public headers compile as
  // C++17 too.
  /// Equal when namespace and name are.
  friend bool operator==(const SkipKey& a, const SkipKey& b) {
    return a.ns == b.ns && a.name == b.name;
  }
  friend bool operator!=(const SkipKey& a, const SkipKey& b) { return !(a == b); }
  /// Ordered by namespace, then name.
  friend bool operator<(const SkipKey& a, const SkipKey& b) {
    return a.ns != b.ns ? a.ns < b.ns : a.name < b.name;
  }
};

/// The names a Skippable layer stashes and pops.
struct SkipNames {
  /// Names the layer stashes (for later layers).
  std::vector<std::string> stash;
  /// Names the layer pops (stashed by earlier layers).
  std::vector<std::string> pop;
};

/// Where stashed tensors wait for their pops, on one thread: the one a
/// `UseSkipTracker` installed, else the thread's own (which serves a plain
/// Sequential run).
class SkipTracker {
 public:
  /// Keeps `tensor` (may be undefined) under `key`, replacing what was there.
  void save(const SkipKey& key, at::Tensor tensor);
  /// Takes the tensor stashed under `key` out; throws when there is none.
  at::Tensor load(const SkipKey& key);
  /// Whether a tensor waits under `key`.
  bool contains(const SkipKey& key) const { return tensors_.count(key) > 0; }
  /// How many tensors wait for their pops.
  size_t size() const noexcept { return tensors_.size(); }
  /// Drops every waiting tensor.
  void clear() noexcept { tensors_.clear(); }
  /// Replaces every waiting tensor `t` with `f(t)` (profiling cuts them off
  /// the graph of the layer that stashed them).
  template <typename F>
  void transform(F&& f) {
    for (auto& [key, tensor] : tensors_) tensor = f(tensor);
  }

 private:
  std::map<SkipKey, at::Tensor> tensors_;
};

/// The calling thread's tracker.
SkipTracker& current_skip_tracker();

/// Makes `tracker` the calling thread's tracker until destroyed.
class UseSkipTracker {
 public:
  explicit UseSkipTracker(SkipTracker& tracker);
  ~UseSkipTracker();
  /// Not copyable: it restores the previous tracker exactly once.
  UseSkipTracker(const UseSkipTracker&) = delete;
  /// Not assignable.
  UseSkipTracker& operator=(const UseSkipTracker&) = delete;

 private:
  SkipTracker* previous_;
};

/// The base of a layer with skip connections (derive from it next to
/// torch::nn::Module; see the top of this file).
class Skippable {
 public:
  explicit Skippable(SkipNames names);
  virtual ~Skippable() = default;

  /// The names this layer declares it stashes.
  const std::vector<std::string>& stash_names() const noexcept { return names_.stash; }
  /// The names this layer declares it pops.
  const std::vector<std::string>& pop_names() const noexcept { return names_.pop; }

  /// Puts this layer's skips named in `only` (all of them when empty) into
  /// `ns`; returns this layer.
  Skippable& isolate(const Namespace& ns, const std::vector<std::string>& only = {});
  /// `name` in the namespace this layer put it in.
  SkipKey key(const std::string& name) const;

 protected:
  /// Hands `tensor` (may be undefined) to the later layer that pops `name`.
  void stash(const std::string& name, at::Tensor tensor);
  /// The tensor an earlier layer stashed under `name`.
  at::Tensor pop(const std::string& name);

 private:
  /// "layer DownImpl" (the module's name) for messages.
  std::string who() const;

  SkipNames names_;
  std::map<std::string, uint64_t> namespaces_;
};

/// Where one skip crosses a cut of a Sequential into stages.
struct SkipRouteInfo {
  /// The skip's namespace and name.
  SkipKey key;
  /// The layer (index in the whole Sequential) that stashes it.
  int64_t stash_layer;
  /// The layer that pops it.
  int64_t pop_layer;
};

/// Checks that every skip of `sequential` is stashed by one layer and popped
/// by one later layer; throws c10::ValueError listing every mismatch
/// (naming the layer and the skip) otherwise. Returns each pair found, in
/// the order of their stashing layers.
std::vector<SkipRouteInfo> verify_skippables(const torch::nn::Sequential& sequential);

}  // namespace gpipe
