// The message of the latentmoe::Error a piece of code throws, for tests that check what it says.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

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

// Expects `body` to throw latentmoe::Error whose message contains every one of `parts`.
inline void expect_error(const std::function<void()>& body, const std::vector<std::string>& parts) {
  try {
    body();
  } catch (const Error& error) {
    const std::string message = error.what();
    for (const std::string& part : parts) {
      EXPECT_NE(message.find(part), std::string::npos) << "expected \"" << part << "\" in: " << message;
    }
    return;
  }
  ADD_FAILURE() << "no error; expected one containing \"" << (parts.empty() ? "" : parts.front()) << "\"";
}

}  // namespace latentmoe::testing
