// schedule.cpp — GPipe's fill-drain order as data, its simulation and its picture.
#include "schedule.h"

#include <algorithm>
#include <ostream>
#include <stdexcept>
#include <string>

namespace gpipe::detail {

namespace {

Schedule uniform(int64_t stages, int64_t microbatches, Phase phase, bool reverse) {
  if (stages < 1 || microbatches < 1) {
    throw std::invalid_argument("a schedule needs at least one stage and one micro-batch, got " +
                                std::to_string(stages) + " stages and " +
                                std::to_string(microbatches) + " micro-batches");
  }
  Schedule schedule;
  schedule.microbatches = microbatches;
  schedule.stages.resize(static_cast<size_t>(stages));
  for (auto& actions : schedule.stages) {
    for (int64_t k = 0; k < microbatches; ++k) {
      actions.push_back({phase, reverse ? microbatches - 1 - k : k});
    }
  }
  return schedule;
}

}  // namespace

Schedule gpipe_forward(int64_t stages, int64_t microbatches) {
  return uniform(stages, microbatches, Phase::Forward, /*reverse=*/false);
}

Schedule gpipe_backward(int64_t stages, int64_t microbatches) {
  return uniform(stages, microbatches, Phase::Backward, /*reverse=*/true);
}

std::vector<std::vector<int64_t>> simulate(const Schedule& schedule) {
  const auto stages = static_cast<int64_t>(schedule.stages.size());
  const int64_t m = schedule.microbatches;
  constexpr int64_t kPending = -1;
  // done[phase][stage][microbatch]: tick at which that action ran.
  std::vector<std::vector<std::vector<int64_t>>> done(
      2, std::vector<std::vector<int64_t>>(static_cast<size_t>(stages),
                                           std::vector<int64_t>(static_cast<size_t>(m), kPending)));
  // Whether a phase appears in the schedule at all: a half schedule has no
  // dependency on the other half (that half ran before).
  bool has[2] = {false, false};
  for (const auto& actions : schedule.stages) {
    for (const auto& a : actions) {
      if (a.microbatch < 0 || a.microbatch >= m) {
        throw std::invalid_argument("action for micro-batch " + std::to_string(a.microbatch) +
                                    " in a schedule of " + std::to_string(m) + " micro-batches");
      }
      has[static_cast<int>(a.phase)] = true;
    }
  }
  auto tick_of = [&](Phase p, int64_t j, int64_t i) -> int64_t {
    return done[static_cast<size_t>(p)][static_cast<size_t>(j)][static_cast<size_t>(i)];
  };

  std::vector<std::vector<int64_t>> ticks(static_cast<size_t>(stages));
  std::vector<size_t> next(static_cast<size_t>(stages), 0);
  std::vector<int64_t> free_at(static_cast<size_t>(stages), 0);
  size_t remaining = 0;
  for (const auto& actions : schedule.stages) remaining += actions.size();

  while (remaining > 0) {
    bool progressed = false;
    for (int64_t j = 0; j < stages; ++j) {
      const auto& actions = schedule.stages[static_cast<size_t>(j)];
      auto& k = next[static_cast<size_t>(j)];
      if (k == actions.size()) continue;
      const Action a = actions[k];
      int64_t ready = free_at[static_cast<size_t>(j)];
      bool blocked = false;
      auto need = [&](Phase p, int64_t stage) {
        if (!has[static_cast<int>(p)]) return;
        const int64_t t = tick_of(p, stage, a.microbatch);
        if (t == kPending) {
          blocked = true;
        } else {
          ready = std::max(ready, t + 1);
        }
      };
      if (a.phase == Phase::Forward) {
        if (j > 0) need(Phase::Forward, j - 1);
      } else {
        if (j + 1 < stages) need(Phase::Backward, j + 1);
        need(Phase::Forward, j);
      }
      if (blocked) continue;
      done[static_cast<size_t>(a.phase)][static_cast<size_t>(j)][static_cast<size_t>(a.microbatch)] =
          ready;
      ticks[static_cast<size_t>(j)].push_back(ready);
      free_at[static_cast<size_t>(j)] = ready + 1;
      ++k;
      --remaining;
      progressed = true;
    }
    if (!progressed) {
      throw std::invalid_argument("schedule cannot complete: some action waits for one that never runs");
    }
  }
  return ticks;
}

std::vector<Step> serialize(const Schedule& schedule) {
  const auto ticks = simulate(schedule);
  struct Timed {
    int64_t tick;
    Step step;
  };
  std::vector<Timed> all;
  for (size_t j = 0; j < schedule.stages.size(); ++j) {
    for (size_t k = 0; k < schedule.stages[j].size(); ++k) {
      all.push_back({ticks[j][k], {static_cast<int64_t>(j), schedule.stages[j][k]}});
    }
  }
  // Within one tick, actions are independent of each other; forward flows
  // down the stages and backward up, so order by stage in each direction.
  std::stable_sort(all.begin(), all.end(), [](const Timed& a, const Timed& b) {
    if (a.tick != b.tick) return a.tick < b.tick;
    return a.step.stage < b.step.stage;
  });
  std::vector<Step> steps;
  steps.reserve(all.size());
  for (const auto& t : all) steps.push_back(t.step);
  return steps;
}

std::ostream& operator<<(std::ostream& out, const Action& action) {
  return out << (action.phase == Phase::Forward ? 'F' : 'B') << action.microbatch;
}

std::string render(const Schedule& schedule) {
  const auto ticks = simulate(schedule);
  const std::string empty_cell =
      std::string(std::to_string(std::max<int64_t>(schedule.microbatches - 1, 0)).size() + 1, '.');
  std::string out;
  for (size_t j = 0; j < schedule.stages.size(); ++j) {
    // A row ends at its stage's last action: no trailing empty cells.
    int64_t row_width = 0;
    for (int64_t t : ticks[j]) row_width = std::max(row_width, t + 1);
    std::vector<std::string> cells(static_cast<size_t>(row_width), empty_cell);
    for (size_t k = 0; k < schedule.stages[j].size(); ++k) {
      const Action a = schedule.stages[j][k];
      std::string cell = (a.phase == Phase::Forward ? "F" : "B") + std::to_string(a.microbatch);
      cell.resize(empty_cell.size(), ' ');
      cells[static_cast<size_t>(ticks[j][k])] = cell;
    }
    std::string line = "stage " + std::to_string(j) + ":";
    for (const auto& c : cells) line += " " + c;
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

}  // namespace gpipe::detail
