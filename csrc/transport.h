// transport.h — how a stage's output reaches the next stage (and a grad the previous one): one small interface, in-process mailboxes behind it.
//
// A run hands batches between stages at addresses (receiving stage, flow,
// micro-batch): activations flow to stage s+1, grads to stage s-1. Every
// implementation carries a batch with the metadata below; the in-process one
// passes the tensors themselves (and the producer's ready events, see
// streams.h), a process-group one sends `encode(describe(batch))` as a small
// header before the tensors so the receiver can allocate them, whatever
// shapes this step has. Schedules and stages never know which one runs.
//
//   stage s worker:   F(s, i) ... send({s+1, Activation, i}, y)
//   stage s+1 worker:               receive({s+1, Activation, i}) -> y
#pragma once

#include "cancel.h"
#include "microbatch.h"
#include "streams.h"

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

namespace gpipe::detail {

/// What crosses a stage boundary, per value of a batch.
struct ValueMeta {
  bool defined = false;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  c10::Device device{c10::kCPU};
  bool requires_grad = false;

  bool operator==(const ValueMeta& other) const = default;
};

struct BatchMeta {
  /// Whether the batch was one tensor (not a tuple of one).
  bool atomic = true;
  std::vector<ValueMeta> values;

  bool operator==(const BatchMeta& other) const = default;
};

BatchMeta describe(const Batch& batch);
/// The metadata as integers (what a header message carries), and back.
/// `decode` throws c10::Error on a malformed header.
std::vector<int64_t> encode(const BatchMeta& meta);
BatchMeta decode(const std::vector<int64_t>& header);

/// Activations go to the next stage and grads to the previous one; a skip
/// (a tensor one layer stashes and a later stage's layer pops) goes straight
/// along its route, and its grad straight back.
enum class Flow : uint8_t { Activation, Grad, Skip, SkipGrad };

struct Address {
  /// The receiving stage.
  int64_t stage;
  Flow flow;
  int64_t microbatch;
  /// Skip and SkipGrad: the route's number (see SkipRoute).
  int64_t route = 0;
};

/// A skip connection across stages: what stage `from` stashes, stage `to`
/// (later) pops. A stage's layers take its main input values followed by
/// one value per route arriving there, and return their main outputs
/// followed by one value per route leaving there, both in route order.
struct SkipRoute {
  int64_t from;
  int64_t to;
};

class Transport : public Cancellable {
 public:
  /// Hands `payload` to whoever receives at `to`; does not wait for them.
  virtual void send(const Address& to, Payload payload) = 0;
  /// Waits for what was sent to `at`; std::nullopt once cancelled.
  virtual std::optional<Payload> receive(const Address& at) = 0;
  // cancel() (Cancellable) wakes every waiting `receive`; later ones return
  // std::nullopt at once.
};

/// The in-process hand-off: one slot per address, written once, taken once.
/// `routes`: how many skip routes the run has.
/// A receiver spins briefly before it parks (a CPU cell can be shorter than
/// waking a parked thread); a sender notifies only when someone is parked.
class Mailboxes final : public Transport {
 public:
  Mailboxes(int64_t stages, int64_t microbatches, int64_t routes = 0);
  void send(const Address& to, Payload payload) override;
  std::optional<Payload> receive(const Address& at) override;
  void cancel() override;
  bool cancelled() const override { return cancelled_.load(); }

 private:
  struct Slot {
    Payload payload;
    std::atomic<bool> full{false};
  };
  // One per receiving stage: its worker parks there.
  struct Box {
    std::mutex mutex;
    std::condition_variable arrived;
    std::atomic<int> parked{0};
  };
  Slot& slot(const Address& a);

  int64_t stages_;
  int64_t microbatches_;
  int64_t routes_;
  std::vector<Slot> slots_;
  std::vector<Box> boxes_;
  std::atomic<bool> cancelled_{false};
};

}  // namespace gpipe::detail
