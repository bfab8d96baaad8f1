// consumer.cpp — uses the installed headers and library: prints gpipe::to_string(Checkpoint::Always).
#include <gpipe/options.h>

#include <iostream>

int main() {
  auto options = gpipe::PipeOptions().balance({1, 1}).chunks(2).checkpoint(gpipe::Checkpoint::Always);
  std::cout << gpipe::to_string(options.checkpoint()) << "\n";
  return options.chunks() == 2 ? 0 : 1;
}
