// trace.cpp — recording events, and what a trace says: Chrome JSON, bubble, busy time.
#include "trace.h"

#include "check.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

namespace gpipe {

const char* to_string(TracePhase phase) {
  switch (phase) {
    case TracePhase::Forward: return "forward";
    case TracePhase::Backward: return "backward";
    case TracePhase::Recompute: return "recompute";
    case TracePhase::Copy: return "copy";
    case TracePhase::Loss: return "loss";
    case TracePhase::InputGrad: return "input_grad";
    case TracePhase::WeightGrad: return "weight_grad";
    case TracePhase::Send: return "send";
    case TracePhase::Receive: return "receive";
  }
  return "unknown";
}

namespace {

// The box name's prefix (the micro-batch follows).
const char* letter(TracePhase phase) {
  switch (phase) {
    case TracePhase::Forward: return "F";
    case TracePhase::Backward: return "B";
    case TracePhase::Recompute: return "R";
    case TracePhase::Copy: return "C";
    case TracePhase::Loss: return "L";
    case TracePhase::InputGrad: return "I";
    case TracePhase::WeightGrad: return "W";
    case TracePhase::Send: return "Tx";
    case TracePhase::Receive: return "Rx";
  }
  return "?";
}

// Not work: a stage moving data or waiting for it, not computing.
bool moves(TracePhase phase) {
  return phase == TracePhase::Copy || phase == TracePhase::Send || phase == TracePhase::Receive;
}

std::string fixed(double value, int digits) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.*f", digits, value);
  return buffer;
}

}  // namespace

std::string TraceSummary::to_string() const {
  std::ostringstream out;
  out << steps << " step(s), " << stages << " stage(s), up to " << microbatches
      << " micro-batch(es): bubble " << fixed(bubble, 3) << " (GPipe ideal "
      << fixed(ideal_bubble, 3) << "), span " << fixed(span_us / 1000.0, 3) << " ms\n";
  for (size_t j = 0; j < busy_us.size(); ++j) {
    const double share = span_us > 0 ? busy_us[j] / span_us : 0.0;
    out << "  stage " << j << ": busy " << fixed(busy_us[j] / 1000.0, 3) << " ms ("
        << fixed(100.0 * share, 1) << "% of the span)\n";
  }
  return out.str();
}

std::string Trace::to_chrome_json() const {
  int64_t stages = 0;
  for (const auto& e : events) stages = std::max(stages, e.stage + 1);
  std::ostringstream out;
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  auto comma = [&] {
    if (!first) out << ",";
    first = false;
  };
  for (int64_t j = 0; j < stages; ++j) {
    comma();
    out << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":" << j
        << ",\"args\":{\"name\":\"stage " << j << "\"}}";
    comma();
    out << "{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":0,\"tid\":" << j
        << ",\"args\":{\"sort_index\":" << j << "}}";
  }
  for (const auto& e : events) {
    comma();
    out << "{\"name\":\"" << letter(e.phase) << e.microbatch << "\",\"cat\":\""
        << gpipe::to_string(e.phase) << "\",\"ph\":\"X\",\"pid\":0,\"tid\":" << e.stage
        << ",\"ts\":" << fixed(e.start_us, 3) << ",\"dur\":" << fixed(e.end_us - e.start_us, 3)
        << ",\"args\":{\"step\":" << e.step << ",\"microbatch\":" << e.microbatch
        << ",\"thread\":" << e.thread;
    if (e.peer >= 0) out << ",\"peer\":" << e.peer;
    out << "}}";
  }
  out << "]}\n";
  return out.str();
}

void Trace::save_chrome_json(const std::string& path) const {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  TORCH_CHECK(file.good(), "cannot open '", path, "' to write the trace; check the directory exists");
  file << to_chrome_json();
  file.close();
  TORCH_CHECK(file.good(), "writing the trace to '", path, "' failed");
}

TraceSummary Trace::summary() const {
  TraceSummary s;
  // (step, half) -> [first start, last end] of its compute events, and the
  // number of micro-batches per step.
  std::map<std::pair<int64_t, int>, std::pair<double, double>> halves;
  std::map<int64_t, int64_t> microbatches;
  for (const auto& e : events) s.stages = std::max(s.stages, e.stage + 1);
  s.busy_us.assign(static_cast<size_t>(s.stages), 0.0);
  // A train_step step (it has loss events) interleaves forwards and
  // backwards: it is one span, not two halves.
  std::set<int64_t> whole_steps;
  for (const auto& e : events) {
    if (e.phase == TracePhase::Loss) whole_steps.insert(e.step);
  }
  for (const auto& e : events) {
    if (moves(e.phase)) continue;
    s.busy_us[static_cast<size_t>(e.stage)] += e.end_us - e.start_us;
    const int half = e.phase == TracePhase::Forward || whole_steps.count(e.step) != 0 ? 0 : 1;
    auto [it, fresh] = halves.try_emplace({e.step, half}, e.start_us, e.end_us);
    if (!fresh) {
      it->second.first = std::min(it->second.first, e.start_us);
      it->second.second = std::max(it->second.second, e.end_us);
    }
    auto& m = microbatches[e.step];
    m = std::max(m, e.microbatch + 1);
  }
  for (const auto& [key, span] : halves) s.span_us += span.second - span.first;
  for (const auto& [step, m] : microbatches) s.microbatches = std::max(s.microbatches, m);
  s.steps = static_cast<int64_t>(microbatches.size());
  double busy = 0;
  for (double b : s.busy_us) busy += b;
  // Several stages on one worker (virtual stages) share its time: count
  // workers, not stages, in a train_step trace.
  int64_t lanes = s.stages;
  if (!whole_steps.empty()) {
    std::set<int64_t> threads;
    for (const auto& e : events) {
      if (!moves(e.phase)) threads.insert(e.thread);
    }
    lanes = std::min<int64_t>(lanes, static_cast<int64_t>(threads.size()));
  }
  if (lanes > 0 && s.span_us > 0) {
    s.bubble = 1.0 - busy / (static_cast<double>(lanes) * s.span_us);
  }
  if (s.stages > 0 && s.microbatches > 0) {
    s.ideal_bubble = static_cast<double>(s.stages - 1) /
                     static_cast<double>(s.microbatches + s.stages - 1);
  }
  return s;
}

namespace detail {

namespace {

int64_t thread_number() {
  static std::atomic<int64_t> next{0};
  thread_local const int64_t number = next.fetch_add(1, std::memory_order_relaxed);
  return number;
}

using Micro = std::chrono::duration<double, std::micro>;

// A timing event recorded on an otherwise idle stream of `device` and the
// host time it ran at (see Tracer in trace.h).
struct Reference {
  c10::Device device;
  c10::Event event;
  Tracer::Clock::time_point host;
};

Reference reference(c10::Device device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  // High priority: the lanes take low-priority pool streams, so this one
  // has nothing of ours queued and runs the event at once.
  const c10::Stream idle = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
  c10::Event event(device.type(), c10::EventFlag::BACKEND_DEFAULT);
  const auto before = Tracer::Clock::now();
  event.record(idle);
  event.synchronize();
  const auto after = Tracer::Clock::now();
  return Reference{device, std::move(event), before + (after - before) / 2};
}

}  // namespace

namespace {

// An event without its times, for the calling thread.
TraceEvent untimed(int64_t step, int64_t stage, int64_t microbatch, TracePhase phase) {
  TraceEvent e;
  e.step = step;
  e.stage = stage;
  e.microbatch = microbatch;
  e.phase = phase;
  e.thread = thread_number();
  return e;
}

}  // namespace

void Tracer::record(int64_t step, int64_t stage, int64_t microbatch, TracePhase phase,
                    Clock::time_point start, Clock::time_point end, int32_t peer) {
  TraceEvent e = untimed(step, stage, microbatch, phase);
  e.peer = peer;
  e.start_us = Micro(start - origin_).count();
  e.end_us = Micro(end - origin_).count();
  std::lock_guard<std::mutex> hold(mutex_);
  keep(e);
}

void Tracer::record(int64_t step, int64_t stage, int64_t microbatch, TracePhase phase,
                    c10::Event start, c10::Event end) {
  TraceEvent e = untimed(step, stage, microbatch, phase);
  std::lock_guard<std::mutex> hold(mutex_);
  pending_.push_back(Pending{e, std::move(start), std::move(end)});
  if (pending_.size() >= next_resolve_) {
    resolve(/*wait=*/false);
    next_resolve_ = pending_.size() + 4096;
  }
}

void Tracer::resolve(bool wait) const {
  if (pending_.empty()) return;
  // Which pending events are done, and on which devices.
  std::vector<bool> done(pending_.size(), false);
  std::vector<c10::Device> devices;
  for (size_t p = 0; p < pending_.size(); ++p) {
    if (wait) pending_[p].end.synchronize();
    done[p] = wait || pending_[p].end.query();
    const auto device = pending_[p].end.device();
    if (done[p] && std::find(devices.begin(), devices.end(), device) == devices.end()) {
      devices.push_back(device);
    }
  }
  if (devices.empty()) return;
  // A fresh reference per device, recorded after every resolved end event
  // completed, so it is later than all of them on the device's clock.
  std::vector<Reference> references;
  references.reserve(devices.size());
  for (const auto& device : devices) references.push_back(reference(device));

  std::vector<Pending> still;
  for (size_t p = 0; p < pending_.size(); ++p) {
    auto& item = pending_[p];
    if (!done[p]) {
      still.push_back(std::move(item));
      continue;
    }
    const auto device = item.end.device();
    const auto& ref = *std::find_if(references.begin(), references.end(),
                                    [&](const Reference& r) { return r.device == device; });
    // elapsedTime: milliseconds from this event to the other.
    const double to_ref_us = item.start.elapsedTime(ref.event) * 1000.0;
    const double length_us = item.start.elapsedTime(item.end) * 1000.0;
    TraceEvent e = item.event;
    e.start_us = Micro(ref.host - origin_).count() - to_ref_us;
    e.end_us = e.start_us + length_us;
    keep(e);
  }
  pending_ = std::move(still);
  // At least one event was resolved (kept, or dropped with its step).
  std::stable_sort(events_.begin(), events_.end(),
                   [](const TraceEvent& a, const TraceEvent& b) { return a.end_us < b.end_us; });
}

void Tracer::keep(const TraceEvent& e) const {
  if (e.step <= dropped_through_) {
    ++dropped_;
    return;
  }
  events_.push_back(e);
  ++per_step_[e.step];
  trim();
}

void Tracer::trim() const {
  while (events_.size() > capacity_) {
    const auto oldest = per_step_.begin();
    if (per_step_.size() == 1) {
      // The newest step alone is over the capacity: keep its newest events.
      const auto excess = events_.size() - capacity_;
      events_.erase(events_.begin(), events_.begin() + static_cast<std::ptrdiff_t>(excess));
      oldest->second -= static_cast<int64_t>(excess);
      dropped_ += static_cast<int64_t>(excess);
      return;
    }
    // Steps mostly end in order, so the oldest step's events are mostly at
    // the front; a forward of the next step may have ended in between.
    const int64_t step = oldest->first;
    int64_t left = oldest->second;
    while (left > 0 && events_.front().step == step) {
      events_.pop_front();
      --left;
    }
    if (left > 0) {
      const auto from = std::remove_if(events_.begin(), events_.end(),
                                       [&](const TraceEvent& e) { return e.step == step; });
      events_.erase(from, events_.end());
    }
    dropped_ += oldest->second;
    dropped_through_ = std::max(dropped_through_, step);
    per_step_.erase(oldest);
  }
}

void Tracer::set_capacity(int64_t events) {
  GPIPE_CHECK_VALUE(events >= 1, "the trace capacity must be at least 1 event, got ", events,
                    "; it is how many of the most recent events a Pipe keeps (default ",
                    kDefaultTraceCapacity, ")");
  std::lock_guard<std::mutex> hold(mutex_);
  capacity_ = static_cast<size_t>(events);
  trim();
}

int64_t Tracer::capacity() const {
  std::lock_guard<std::mutex> hold(mutex_);
  return static_cast<int64_t>(capacity_);
}

Trace Tracer::snapshot() const {
  std::lock_guard<std::mutex> hold(mutex_);
  resolve(/*wait=*/true);
  return Trace{std::vector<TraceEvent>(events_.begin(), events_.end()), dropped_};
}

void Tracer::clear() {
  std::lock_guard<std::mutex> hold(mutex_);
  events_.clear();
  per_step_.clear();
  dropped_ = 0;
  dropped_through_ = -1;
  pending_.clear();
  next_resolve_ = 4096;
  steps_.store(0, std::memory_order_relaxed);
}

void Span::restart(const c10::Stream& stream) {
  if (!active_) return;
  if (stream.device().is_cpu()) {
    restart();
    return;
  }
  c10::Event start(stream.device_type(), c10::EventFlag::BACKEND_DEFAULT);
  start.record(stream);
  start_.reset();
  device_start_.emplace(std::move(start));
  stream_ = stream;
}

void Span::finish() {
  if (!active_) return;
  active_ = false;
  if (device_start_) {
    c10::Event end(stream_->device_type(), c10::EventFlag::BACKEND_DEFAULT);
    end.record(*stream_);
    tracer_.record(step_, stage_, microbatch_, phase_, std::move(*device_start_), std::move(end));
    device_start_.reset();
  } else if (start_) {
    tracer_.record(step_, stage_, microbatch_, phase_, *start_, Tracer::Clock::now());
    start_.reset();
  }
}

}  // namespace detail

}  // namespace gpipe
