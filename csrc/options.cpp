// options.cpp — printing checkpoint modes.
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

}  // namespace gpipe
