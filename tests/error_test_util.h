// The message of the latentmoe::Error a piece of code throws, for tests that check what it says.
#pragma once

#include <functional>
#include <string>

#include "latentmoe/error.h"

namespace latentmoe::testing {

// What `body` throws as latentmoe::Error, or "(no error)" when it returns normally.
inline std::string message_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const Error& error) {
    return error.what();
  }
  return "(no error)";
}

}  // namespace latentmoe::testing
