// bench.h — what every C++ benchmark shares: clocks, medians, the --quick switch, tables, BENCH lines.
//
// Header-only on purpose: CMake builds every bench/*.cpp as its own
// executable (bench_<name>), so shared code lives here, not in a .cpp.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace bench {

using Clock = std::chrono::steady_clock;

/// Seconds from `start` to now, on the steady clock.
inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// CPU seconds (user + system) this process has used, all threads together.
inline double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

/// The median of `values` (the mean of the middle two for an even count).
inline double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

/// Runs `step` `warmup` times untimed, then `reps` times, and returns the
/// seconds each timed run took.
template <typename Step>
std::vector<double> time_runs(Step&& step, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) step();
  std::vector<double> out;
  out.reserve(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    const auto start = Clock::now();
    step();
    out.push_back(seconds_since(start));
  }
  return out;
}

/// True when asked for the tiny smoke configuration: `--quick` among the
/// arguments, or BENCH_QUICK set to anything but "" or "0".
inline bool quick(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) return true;
  }
  const char* env = std::getenv("BENCH_QUICK");
  return env != nullptr && *env != '\0' && std::strcmp(env, "0") != 0;
}

/// `value` with `digits` digits after the point.
inline std::string fixed(double value, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, value);
  return buf;
}

/// A plain-text table: a header row, then rows of cells, columns
/// right-aligned to their widest cell.
class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}

  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }

  void print() const {
    std::vector<size_t> width(header_.size(), 0);
    auto widen = [&](const std::vector<std::string>& row) {
      for (size_t c = 0; c < row.size() && c < width.size(); ++c) {
        width[c] = std::max(width[c], row[c].size());
      }
    };
    widen(header_);
    for (const auto& r : rows_) widen(r);
    auto line = [&](const std::vector<std::string>& row) {
      std::string s;
      for (size_t c = 0; c < width.size(); ++c) {
        const std::string cell = c < row.size() ? row[c] : "";
        s += (c ? "  " : "") + std::string(width[c] - cell.size(), ' ') + cell;
      }
      std::printf("%s\n", s.c_str());
    };
    line(header_);
    std::vector<std::string> rule;
    for (size_t w : width) rule.emplace_back(w, '-');
    line(rule);
    for (const auto& r : rows_) line(r);
    std::fflush(stdout);
  }

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

/// Wall time of each step, and CPU time (all threads) over all of them.
struct Timing {
  std::vector<double> wall;
  double cpu = 0;
  void run(const std::function<void()>& step) {
    const double cpu_start = process_cpu_seconds();
    const auto start = Clock::now();
    step();
    wall.push_back(seconds_since(start));
    cpu += process_cpu_seconds() - cpu_start;
  }
  double cores() const {
    double sum = 0;
    for (double w : wall) sum += w;
    return sum > 0 ? cpu / sum : 0;
  }
};

}  // namespace bench
