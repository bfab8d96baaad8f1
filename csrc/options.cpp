// options.cpp — printing checkpoint modes and schedules.
#include <gpipe/options.h>

namespace gpipe {

std::string to_string(Checkpoint checkpoint) {
  switch (checkpoint) {
    case Checkpoint::Always:
      return "always";
    case Checkpoint::ExceptLast:
      return "except_last";
    case Checkpoint::Never:
      return "never";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& stream, Checkpoint checkpoint) {
  return stream << to_string(checkpoint);
}

std::string to_string(Schedule schedule) {
  switch (schedule) {
    case Schedule::GPipe:
      return "gpipe";
    case Schedule::OneFOneB:
      return "1f1b";
    case Schedule::Interleaved1F1B:
      return "interleaved_1f1b";
    case Schedule::ZBH1:
      return "zb_h1";
    case Schedule::ZBV:
      return "zb_v";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& stream, Schedule schedule) {
  return stream << to_string(schedule);
}

}  // namespace gpipe
