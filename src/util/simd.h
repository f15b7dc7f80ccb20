// The x86 intrinsics, included through one place: GCC 12's AVX-512 headers
// warn about their own "undefined" pass-through operands (GCC bug 105593), so
// those two warnings are silenced here for every file that uses intrinsics.
// Include this first in such a file (the pragmas apply from here on).
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
