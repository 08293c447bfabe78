"""C++ the CUTLASS host glues share to turn CUTLASS's silent host failures into errors.

CUTLASS encodes TMA descriptors on the host (`to_underlying_arguments`) and, when an encode fails,
only prints and `assert()`s -- compiled out by -DNDEBUG, so a kernel would launch with an unset
descriptor (and an enabled assert would abort the caller's Python process).  `TMA_HOOK` routes
every encode through `kspec_tma`, which records the status, so `kspec_prepare` fails with the
argument's ABI position and the CUresult instead (`TMA_CHECK`).  The chain of a call:
CUTLASS -> kspec_tma::encode_* (records) -> cutlass::call_* -> cuTensorMapEncodeTiled, which
tma_hook.py defines (an installed encoder, e.g. the fake driver's, else the driver's).
Include TMA_HOOK after tma_hook.PRELUDE and before any other CUTLASS header.
"""


# The hook replaces the CUTLASS_CUDA_DRIVER_WRAPPER_CALL macro after cuda_host_adapter.hpp defined
# it and before the TMA headers use it (they expand it when they are parsed).
TMA_HOOK = """#if defined(KSPEC_HOST)
#include <exception>
#include <cuda.h>
#include <cuda_runtime.h>
#include "cutlass/cuda_host_adapter.hpp"
namespace kspec_tma {
struct Record { int encoded; int failures; CUresult first; const void* address; };
inline Record& record() { static thread_local Record r{0, 0, CUDA_SUCCESS, nullptr}; return r; }
inline void reset() { record() = Record{0, 0, CUDA_SUCCESS, nullptr}; }
inline CUresult note(CUresult result, const void* address) {
  Record& r = record();
  ++r.encoded;
  if (result != CUDA_SUCCESS && r.failures++ == 0) { r.first = result; r.address = address; }
  return result;
}
template <class Map, class Type, class Rank, class... Rest>
CUresult encode_cuTensorMapEncodeTiled(Map map, Type type, Rank rank, void* address, Rest... rest) {
  return note(cutlass::call_cuTensorMapEncodeTiled(map, type, rank, address, rest...), address);
}
template <class Map, class Type, class Rank, class... Rest>
CUresult encode_cuTensorMapEncodeIm2col(Map map, Type type, Rank rank, void* address, Rest... rest) {
  return note(cutlass::call_cuTensorMapEncodeIm2col(map, type, rank, address, rest...), address);
}
}  // namespace kspec_tma
#undef CUTLASS_CUDA_DRIVER_WRAPPER_CALL
#define CUTLASS_CUDA_DRIVER_WRAPPER_CALL(func) kspec_tma::encode_##func
#endif  // KSPEC_HOST
"""


# kspec_prepare's check after to_underlying_arguments: `{ptrs}`/`{nargs}`/`{fail}` are filled by
# the caller (the ptrs array, how many tensor arguments, and a statement that returns the error).
TMA_CHECK = """  {{
    const kspec_tma::Record& tma = kspec_tma::record();
    if (tma.failures != 0) {{
      int which = -1;
      for (int i = 0; i < {nargs}; ++i) {{
        if ({ptrs}[i] == tma.address) {{ which = i; break; }}
      }}
      char tma_msg[384];
      if (which >= 0)
        std::snprintf(tma_msg, sizeof(tma_msg), "argument #%d: its TMA descriptor failed to encode "
                      "(cuTensorMapEncodeTiled returned CUresult %d; %d of %d descriptors failed)",
                      which, static_cast<int>(tma.first), tma.failures, tma.encoded);
      else
        std::snprintf(tma_msg, sizeof(tma_msg), "a TMA descriptor for address %p failed to encode "
                      "(cuTensorMapEncodeTiled returned CUresult %d; %d of %d descriptors failed)",
                      tma.address, static_cast<int>(tma.first), tma.failures, tma.encoded);
      {fail}
    }}
  }}
"""
