// lynx: the one exception type the library throws.
#pragma once

#include <stdexcept>
#include <string>

namespace lynx {

// Thrown for every invalid argument and every failure the library detects. `argument()` names the
// argument at fault ("x", "topk_ids", "config.schedule_capacity", ...) or is empty for runtime failures.
class Error : public std::runtime_error {
 public:
  Error(std::string argument, const std::string& message)
      : std::runtime_error(argument.empty() ? "lynx: " + message : "lynx: " + argument + ": " + message),
        argument_(std::move(argument)) {}

  const std::string& argument() const noexcept { return argument_; }

 private:
  std::string argument_;
};

}  // namespace lynx
