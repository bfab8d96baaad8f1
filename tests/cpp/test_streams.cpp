// test_streams.cpp — the stream orderings of streams.h on a pretend accelerator: who waits for whom at a step's start and end, and when values are handed back.
#include "fake_accelerator.h"
#include "pipe_backward.h"
#include "streams.h"

#include <catch2/catch.hpp>
#include <c10/core/StreamGuard.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <vector>

using gpipe::detail::current_streams_wait_for;
using gpipe::detail::Lane;
using gpipe::detail::make_lane;
using gpipe::detail::mark;
using gpipe::detail::Payload;
using gpipe::detail::settle;
using gpipe::detail::stream_leaf_edges;
using gpipe::detail::wait_for_current_streams;
using gpipe_test::FakeAccelerator;
using gpipe_test::FakeWork;

namespace {

// A tensor that claims to live on `device` (no kernel ever runs on it).
at::Tensor on_fake(c10::Device device, float* data) {
  return at::for_blob(data, {1})
      .target_device(device)
      .options(at::TensorOptions().dtype(at::kFloat).device(device))
      .make_tensor();
}

// One piece of work on every stream of the lane.
std::vector<FakeWork> busy(const Lane& lane) {
  std::vector<FakeWork> out{FakeAccelerator::enqueue(lane.compute),
                            FakeAccelerator::enqueue(lane.copy)};
  for (const auto& s : lane.sources->all()) out.push_back(FakeAccelerator::enqueue(s));
  return out;
}

}  // namespace

TEST_CASE("streams: the fake accelerator orders a stream after another only through an event",
          "[streams]") {
  FakeAccelerator::install();
  const auto a = FakeAccelerator::pool_stream(0);
  const auto b = FakeAccelerator::pool_stream(1);
  CHECK(a != FakeAccelerator::pool_stream(0));  // round-robin pool
  const FakeWork w = FakeAccelerator::enqueue(a);
  CHECK(FakeAccelerator::after(a, w));
  CHECK_FALSE(FakeAccelerator::after(b, w));
  auto marks = mark(a);
  REQUIRE(marks.size() == 1);
  const FakeWork later = FakeAccelerator::enqueue(a);
  marks.front()->block(b);  // a wait on another device's event
  CHECK(FakeAccelerator::after(b, w));
  CHECK_FALSE(FakeAccelerator::after(b, later));
}

TEST_CASE("streams: at a step's start every lane stream comes after the caller's current stream "
          "on its device",
          "[streams]") {
  FakeAccelerator::install();
  const Lane lane = make_lane(FakeAccelerator::device(0));
  const auto source = lane.sources->on(FakeAccelerator::device(1));
  const c10::StreamGuard user0(FakeAccelerator::pool_stream(0));
  const c10::StreamGuard user1(FakeAccelerator::pool_stream(1));
  const FakeWork step0 = FakeAccelerator::enqueue(FakeAccelerator::current_stream(0));
  const FakeWork step1 = FakeAccelerator::enqueue(FakeAccelerator::current_stream(1));
  wait_for_current_streams({&lane});
  CHECK(FakeAccelerator::after(lane.compute, step0));
  CHECK(FakeAccelerator::after(lane.copy, step0));
  CHECK(FakeAccelerator::after(source, step1));
}

TEST_CASE("streams: at a step's end every device's current and default streams come after every "
          "lane's work, on every device (issue 23 item 7)",
          "[streams]") {
  // Autograd (torch 2.9+) orders a consumer of x.grad on device 0 after
  // PipeBackward's stream, the current stream of the OUTPUT's device (1):
  // that stream must come after the lane on device 0 too.
  FakeAccelerator::install();
  const Lane first = make_lane(FakeAccelerator::device(0));
  const Lane last = make_lane(FakeAccelerator::device(1));
  first.sources->on(FakeAccelerator::device(1));
  const c10::StreamGuard user0(FakeAccelerator::pool_stream(0));  // torch.cuda.stream(s)
  const c10::StreamGuard user1(FakeAccelerator::pool_stream(1));
  std::vector<FakeWork> work = busy(first);
  for (const auto& w : busy(last)) work.push_back(w);
  CHECK_FALSE(FakeAccelerator::after(FakeAccelerator::current_stream(1), work.front()));

  current_streams_wait_for({&first, &last});
  for (c10::DeviceIndex d : {0, 1}) {
    for (const auto& w : work) {
      INFO("device " << int(d) << ", work on stream " << w.stream);
      CHECK(FakeAccelerator::after(FakeAccelerator::current_stream(d), w));
      CHECK(FakeAccelerator::after(FakeAccelerator::default_stream(d), w));
    }
  }
}

TEST_CASE("streams: at a backward's end the copies that took grads home come before every current "
          "stream, and every lane before theirs",
          "[streams]") {
  // An input on device 2, stages on 0 and 1: its grad is copied home on
  // the current streams of 0 and 2; autograd's consumer waits for device
  // 1's current stream (PipeBackward's).
  FakeAccelerator::install();
  const Lane first = make_lane(FakeAccelerator::device(0));
  const Lane last = make_lane(FakeAccelerator::device(1));
  const FakeWork b0 = FakeAccelerator::enqueue(first.compute);
  const FakeWork copy_home = FakeAccelerator::enqueue(FakeAccelerator::current_stream(2));
  current_streams_wait_for({&first, &last}, {FakeAccelerator::device(2), c10::Device(c10::kCPU)});
  CHECK(FakeAccelerator::after(FakeAccelerator::current_stream(1), copy_home));
  CHECK(FakeAccelerator::after(FakeAccelerator::current_stream(0), copy_home));
  CHECK(FakeAccelerator::after(FakeAccelerator::current_stream(2), b0));
}

TEST_CASE("streams: settle orders the current stream of each tensor's device after the ready "
          "events, recorded on another device too",
          "[streams]") {
  // A stage on device 0 summed a leaf's grads, which live on device 1.
  FakeAccelerator::install();
  const Lane lane = make_lane(FakeAccelerator::device(0));
  const FakeWork sum = FakeAccelerator::enqueue(lane.compute);
  float storage[2] = {0, 0};
  const at::Tensor grad = on_fake(FakeAccelerator::device(1), &storage[0]);
  const at::Tensor here = on_fake(FakeAccelerator::device(0), &storage[1]);
  gpipe::detail::Batch batch({grad, here}, /*is_atomic=*/false);
  const gpipe::detail::Batch out = settle(Payload{std::move(batch), mark(lane.compute)});
  CHECK(FakeAccelerator::after(FakeAccelerator::current_stream(1), sum));
  CHECK(FakeAccelerator::after(FakeAccelerator::current_stream(0), sum));
  // Each is recorded on the stream that reads it (the caching allocator).
  const auto records = FakeAccelerator::records();
  bool grad_recorded = false, here_recorded = false;
  for (const auto& [ptr, stream] : records) {
    grad_recorded |= ptr == &storage[0] && stream == FakeAccelerator::current_stream(1);
    here_recorded |= ptr == &storage[1] && stream == FakeAccelerator::current_stream(0);
  }
  CHECK(grad_recorded);
  CHECK(here_recorded);
  CHECK(out.size() == 2);
}

TEST_CASE("streams: a stream gpipe holds is not handed to another of its lanes, whoever else draws "
          "from the pool (issue 23 item 8)",
          "[streams]") {
  using gpipe::detail::pool_stream_holds;
  using gpipe::detail::take_pool_stream;
  FakeAccelerator::install();
  const auto device = FakeAccelerator::device(0);
  std::vector<c10::Stream> mine;
  {
    const Lane first = make_lane(device);
    // Others in the process (ProcessGroupNCCL, the user) draw 30 more: the
    // pool's round-robin comes back to `first`'s streams next.
    for (int i = 0; i < FakeAccelerator::kPoolSize - 2; ++i) FakeAccelerator::pool_stream(0);
    const Lane second = make_lane(device);
    const c10::Stream side = take_pool_stream(device);
    const auto side_held = gpipe::detail::hold({side});
    mine = {first.compute, first.copy, second.compute, second.copy, side};
    for (size_t a = 0; a < mine.size(); ++a) {
      CHECK(pool_stream_holds(mine[a]) == 1);
      for (size_t b = a + 1; b < mine.size(); ++b) {
        INFO("streams " << a << " and " << b);
        CHECK(mine[a] != mine[b]);
      }
    }
  }
  // Given back when the last holder goes.
  for (const auto& s : mine) CHECK(pool_stream_holds(s) == 0);
}

TEST_CASE("streams: when gpipe holds the whole pool, a new lane shares the least-held streams",
          "[streams]") {
  using gpipe::detail::pool_stream_holds;
  FakeAccelerator::install();
  std::vector<Lane> lanes;
  for (int i = 0; i < FakeAccelerator::kPoolSize / 2 + 1; ++i) {
    lanes.push_back(make_lane(FakeAccelerator::device(1)));
  }
  std::vector<c10::Stream> first;
  for (int i = 0; i < FakeAccelerator::kPoolSize / 2; ++i) {
    first.push_back(lanes[static_cast<size_t>(i)].compute);
    first.push_back(lanes[static_cast<size_t>(i)].copy);
  }
  std::sort(first.begin(), first.end(),
            [](const c10::Stream& a, const c10::Stream& b) { return a.id() < b.id(); });
  CHECK(std::unique(first.begin(), first.end()) == first.end());  // the whole pool, once
  CHECK(lanes.back().compute != lanes.back().copy);
  CHECK(pool_stream_holds(lanes.back().compute) == 2);
  CHECK(pool_stream_holds(lanes.back().copy) == 2);
}

TEST_CASE("streams: a stream leaf per accelerator device holds that device's default stream, "
          "whatever stream is current (issue 23 item 10)",
          "[streams]") {
  // Autograd makes the stream current where backward() was called wait for
  // the stream of every node with no outputs that ran: for a leaf holding a
  // device's default stream, which waited for every lane at the end.
  FakeAccelerator::install();
  const c10::StreamGuard user0(FakeAccelerator::pool_stream(0));
  const auto edges = stream_leaf_edges(
      {FakeAccelerator::device(0), c10::Device(c10::kCPU), FakeAccelerator::device(1),
       FakeAccelerator::device(0)});
  REQUIRE(edges.size() == 2);  // CPU and repeats skipped
  for (size_t e = 0; e < edges.size(); ++e) {
    const auto d = static_cast<c10::DeviceIndex>(e);
    auto& leaf = *edges[e].function;
    CHECK(leaf.name() == "gpipe::StreamLeaf");
    CHECK(leaf.num_outputs() == 0);
    REQUIRE(leaf.num_inputs() == 1);
    CHECK(leaf.input_metadata(0).device() == FakeAccelerator::device(d));
    CHECK(leaf.input_metadata(0).stream() == FakeAccelerator::default_stream(d));
    const auto shape = leaf.input_metadata(0).shape_as_dim_vector();
    CHECK((shape.size() == 1 && shape[0] == 0));
    CHECK(leaf({}).empty());
  }
}
