// How run_ranks starts a rank's thread, replaceable by tests so that a failure to create a thread
// (the system's thread limit) can be provoked. Internal.
#pragma once

#include <functional>
#include <thread>

namespace latentmoe::detail {

using ThreadStarter = std::function<std::thread(int rank, std::function<void()> body)>;

// Replaces the starter (an empty function restores std::thread's); returns the previous one.
ThreadStarter set_thread_starter_for_tests(ThreadStarter starter);

}  // namespace latentmoe::detail
