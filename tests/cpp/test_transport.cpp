// test_transport.cpp — the hand-off interface: batch metadata and its header, the in-process mailboxes.
#include "../../csrc/transport.h"

#include "models.h"

#include <chrono>
#include <thread>

using gpipe::detail::Address;
using gpipe::detail::Batch;
using gpipe::detail::BatchMeta;
using gpipe::detail::decode;
using gpipe::detail::describe;
using gpipe::detail::encode;
using gpipe::detail::Flow;
using gpipe::detail::Mailboxes;
using gpipe::detail::Payload;

TEST_CASE("transport: metadata names every value and survives its header", "[transport]") {
  auto a = torch::randn({3, 4}, torch::kFloat64).requires_grad_(true);
  auto b = torch::arange(5, torch::kLong);
  Batch batch({a, torch::Tensor(), b}, /*is_atomic=*/false);
  const BatchMeta meta = describe(batch);
  REQUIRE(meta.values.size() == 3);
  CHECK_FALSE(meta.atomic);
  CHECK(meta.values[0].defined);
  CHECK(meta.values[0].dtype == torch::kFloat64);
  CHECK(meta.values[0].shape == std::vector<int64_t>{3, 4});
  CHECK(meta.values[0].requires_grad);
  CHECK_FALSE(meta.values[1].defined);
  CHECK(meta.values[2].dtype == torch::kLong);
  CHECK_FALSE(meta.values[2].requires_grad);
  CHECK(decode(encode(meta)) == meta);
  const BatchMeta one = describe(Batch(torch::zeros({}, torch::kFloat32)));
  CHECK(one.atomic);
  CHECK(one.values[0].shape.empty());
  CHECK(decode(encode(one)) == one);

  auto header = encode(meta);
  header.pop_back();
  CHECK_THROWS_WITH(decode(header), Catch::Contains("ends before"));
  header = encode(meta);
  header.push_back(7);
  CHECK_THROWS_WITH(decode(header), Catch::Contains("past its last value"));
  header[0] = 99;
  CHECK_THROWS_WITH(decode(header), Catch::Contains("version 99"));
}

TEST_CASE("transport: mailboxes deliver each address once, in any order", "[transport]") {
  Mailboxes mail(/*stages=*/2, /*microbatches=*/3);
  for (int64_t i = 2; i >= 0; --i) {
    mail.send({1, Flow::Activation, i}, Payload{Batch(torch::full({1}, double(i))), {}});
  }
  mail.send({0, Flow::Grad, 1}, Payload{Batch(torch::full({1}, 10.0)), {}});
  for (int64_t i = 0; i < 3; ++i) {
    auto got = mail.receive({1, Flow::Activation, i});
    REQUIRE(got);
    CHECK(got->batch[0].item<double>() == double(i));
  }
  auto grad = mail.receive({0, Flow::Grad, 1});
  REQUIRE(grad);
  CHECK(grad->batch[0].item<double>() == 10.0);
}

TEST_CASE("transport: a receive waits for its send, and cancel wakes every waiter", "[transport]") {
  Mailboxes mail(2, 2);
  std::thread sender([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    mail.send({1, Flow::Activation, 0}, Payload{Batch(torch::ones({2})), {}});
  });
  auto got = mail.receive({1, Flow::Activation, 0});
  sender.join();
  REQUIRE(got);
  CHECK(got->batch[0].sum().item<double>() == 2.0);

  std::vector<std::thread> waiters;
  std::atomic<int> woke{0};
  for (int64_t s = 0; s < 2; ++s) {
    waiters.emplace_back([&, s] {
      if (!mail.receive({s, Flow::Grad, 1})) ++woke;
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK_FALSE(mail.cancelled());
  mail.cancel();
  for (auto& t : waiters) t.join();
  CHECK(woke == 2);
  CHECK(mail.cancelled());
  CHECK_FALSE(mail.receive({0, Flow::Activation, 1}));  // at once, after cancel
}
