// balance.cpp — the exact min-max contiguous partition, and balancing by parameter count.
#include <gpipe/balance.h>

#include "check.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace gpipe {

std::vector<int64_t> balance_cost(const std::vector<double>& costs, int64_t partitions) {
  const auto n = static_cast<int64_t>(costs.size());
  GPIPE_CHECK_VALUE(n >= 1, "nothing to balance: the model has no layers");
  GPIPE_CHECK_VALUE(partitions >= 1, "partitions must be at least 1, got ", partitions);
  GPIPE_CHECK_VALUE(partitions <= n, "cannot cut ", detail::count(n, "layer"), " into ", partitions,
                    " stages: every stage needs at least one layer; use at most ", n,
                    n == 1 ? " partition" : " partitions");
  for (int64_t i = 0; i < n; ++i) {
    GPIPE_CHECK_VALUE(
        std::isfinite(costs[static_cast<size_t>(i)]) && costs[static_cast<size_t>(i)] >= 0,
        "cost of layer ", i, " is ", costs[static_cast<size_t>(i)],
        "; costs must be finite and non-negative");
  }
  // Stage costs are differences of one prefix-sum table, so the same stage
  // always costs exactly the same: comparisons below are exact.
  std::vector<double> prefix(static_cast<size_t>(n + 1), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    prefix[static_cast<size_t>(i + 1)] = prefix[static_cast<size_t>(i)] + costs[static_cast<size_t>(i)];
  }
  auto cost = [&](int64_t a, int64_t b) {
    return prefix[static_cast<size_t>(b)] - prefix[static_cast<size_t>(a)];
  };
  // best[k][i]: the smallest bottleneck splitting layers i..n-1 into k stages.
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const auto K = static_cast<size_t>(partitions);
  std::vector<std::vector<double>> best(K + 1, std::vector<double>(static_cast<size_t>(n + 1), kInf));
  best[0][static_cast<size_t>(n)] = 0.0;
  for (size_t k = 1; k <= K; ++k) {
    for (int64_t i = n - 1; i >= 0; --i) {
      double b = kInf;
      for (int64_t e = i + 1; e <= n; ++e) {
        const double rest = best[k - 1][static_cast<size_t>(e)];
        if (rest == kInf) continue;
        b = std::min(b, std::max(cost(i, e), rest));
      }
      best[k][static_cast<size_t>(i)] = b;
    }
  }
  const double target = best[K][0];
  // Lexicographically smallest balance achieving the optimum: each stage
  // takes as few layers as still lets the rest fit under the target.
  std::vector<int64_t> balance;
  int64_t i = 0;
  for (size_t k = K; k >= 1; --k) {
    for (int64_t e = i + 1; e <= n; ++e) {
      if (cost(i, e) <= target && best[k - 1][static_cast<size_t>(e)] <= target) {
        balance.push_back(e - i);
        i = e;
        break;
      }
    }
  }
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(balance.size()) == partitions && i == n);
  return balance;
}

std::vector<int64_t> balance_by_params(int64_t partitions, torch::nn::Sequential module) {
  std::vector<double> costs;
  for (const auto& layer : *module) {
    double numel = 0;
    for (const auto& p : layer.ptr()->parameters()) numel += static_cast<double>(p.numel());
    costs.push_back(numel);
  }
  return balance_cost(costs, partitions);
}

}  // namespace gpipe
