// schedule.h — which cell each stage runs, in which order: pure data, no torch.
//
// A schedule is one ordered list of actions per stage. The executor runs each
// list on that stage's worker; the data an action needs arrives from the
// neighbouring stage:
//
//   F(i) on stage j  needs  F(i) of stage j-1   (stage 0: micro-batch i of the input)
//   B(i) on stage j  needs  B(i) of stage j+1   (last stage: grad of output i)
//                    and    F(i) of stage j     (when both halves share a schedule)
//
// GPipe (fill-drain) is two halves run one after the other: every forward,
// then, when `loss.backward()` reaches the Pipe, every backward in reverse
// micro-batch order. 1F1B would interleave both in one list per stage.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace gpipe::detail {

enum class Phase : uint8_t { Forward, Backward };

struct Action {
  Phase phase;
  int64_t microbatch;

  bool operator==(const Action& other) const = default;
};

/// "F3", "B0": how pictures, logs and test failures spell an action.
std::ostream& operator<<(std::ostream& out, const Action& action);

struct Schedule {
  /// stages[j]: the actions of stage j in the order they run.
  std::vector<std::vector<Action>> stages;
  int64_t microbatches = 0;
};

/// One stage's position in a serial order of a schedule.
struct Step {
  int64_t stage;
  Action action;
};

/// The forward half of GPipe: every stage runs F(0) .. F(m-1).
Schedule gpipe_forward(int64_t stages, int64_t microbatches);
/// The backward half of GPipe: every stage runs B(m-1) .. B(0).
Schedule gpipe_backward(int64_t stages, int64_t microbatches);

/// The clock tick at which each action runs when every action takes one tick
/// and starts as soon as its inputs and its stage are free:
/// ticks[j][k] for schedule.stages[j][k]. Throws std::invalid_argument when
/// the schedule cannot complete (an action waits for one that never runs).
std::vector<std::vector<int64_t>> simulate(const Schedule& schedule);

/// Every action of `schedule` in one order that respects its dependencies
/// (by tick, then by stage): what a single thread runs when it drives all
/// stages itself.
std::vector<Step> serialize(const Schedule& schedule);

/// The schedule as a picture, one line per stage, one column per tick:
///   "stage 0: F0 F1 .. ..\nstage 1: .. F0 F1 ..\n"
std::string render(const Schedule& schedule);

}  // namespace gpipe::detail
