// LATENTMOE_DEBUG_CHECK(condition, parts...): LATENTMOE_CHECK in a debug build, nothing under NDEBUG
// (the condition is still compiled, never evaluated). For the arguments of backend operations that
// the runner validated already (src/core/backend.h: operations validate nothing the runner did), so
// that a development build still names a wrong call while eager decode pays no host time for it.
// Host-only; includable from C++.
#pragma once

#include "latentmoe/error.h"

#ifdef NDEBUG
#define LATENTMOE_DEBUG_CHECK(condition, ...)             \
  do {                                                    \
    if (false) LATENTMOE_CHECK((condition), __VA_ARGS__); \
  } while (false)
#else
#define LATENTMOE_DEBUG_CHECK(condition, ...) LATENTMOE_CHECK((condition), __VA_ARGS__)
#endif
