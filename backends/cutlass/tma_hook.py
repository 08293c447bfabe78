"""The host glue's route to `cuTensorMapEncodeTiled`, with one injection point for the fake driver.

CUTLASS encodes TMA descriptors on the host (in `to_underlying_arguments`).  By default it asks the
CUDA runtime for the driver entry point on every call (`cudaGetDriverEntryPointByVersion`), a path
static cudart serves only with a real libcuda.  The glue instead compiles its host pass with
`CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL` and defines `cuTensorMapEncodeTiled` itself: it forwards to
an encoder installed with the exported, optional

    int kspec_set_tensor_map_encoder(void* fn);   // fn has cuTensorMapEncodeTiled's signature; NULL resets

and otherwise to the driver's function, looked up through the CUDA runtime as before.  The glue
still never links libcuda.  `kspec.runtime.fakedriver.FakeDriver` installs a recording encoder, so
the launch-ABI tests see every descriptor the glue encodes, on a machine without a GPU.
"""
from __future__ import annotations

# before any CUTLASS header
PRELUDE = """#if defined(KSPEC_HOST)
#define CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL 1
#endif
"""

# inside the KSPEC_HOST section, at namespace scope, after <cuda_runtime.h> / the CUTLASS headers
HOST_SOURCE = r"""
// cuTensorMapEncodeTiled for CUTLASS (backends/cutlass/tma_hook.py): an installed encoder, else the driver's.
typedef CUresult (*kspec_encode_tiled_fn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                          const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                                          CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                          CUtensorMapFloatOOBfill);
static kspec_encode_tiled_fn kspec_encode_override = nullptr;

extern "C" int kspec_set_tensor_map_encoder(void* fn) {
  kspec_encode_override = reinterpret_cast<kspec_encode_tiled_fn>(fn);
  return 0;
}

static kspec_encode_tiled_fn kspec_tensor_map_encoder() {
  if (kspec_encode_override != nullptr) return kspec_encode_override;
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
  cudaError_t status = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &query);
  if (status != cudaSuccess || query != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<kspec_encode_tiled_fn>(fn);
}

extern "C" CUresult CUDAAPI cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank,
                                                   void* address, const cuuint64_t* dims, const cuuint64_t* strides,
                                                   const cuuint32_t* box, const cuuint32_t* element_strides,
                                                   CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                                   CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob) {
  kspec_encode_tiled_fn encode = kspec_tensor_map_encoder();
  if (encode == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return encode(map, type, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2, oob);
}
"""


# The other driver functions CUTLASS's host code calls directly under CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL
# (the EVT reductions' workspace fill and its error message): defined here, reached through the CUDA
# runtime's entry-point lookup, so the glue still never links libcuda and loads on a machine without
# a driver.  Emitted into GEMM glue whose epilogue has reductions (the only code that uses them).
DRIVER_TRAMPOLINES = r"""
// cuMemsetD32Async / cuGetErrorString for CUTLASS (backends/cutlass/tma_hook.py): through the runtime's entry points.
template <class Fn> static Fn kspec_driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &query) != cudaSuccess ||
      query != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

extern "C" CUresult CUDAAPI cuMemsetD32Async(CUdeviceptr dst, unsigned int value, size_t count, CUstream stream) {
  typedef CUresult (*fn_t)(CUdeviceptr, unsigned int, size_t, CUstream);
  fn_t fn = kspec_driver_entry<fn_t>("cuMemsetD32Async");
  return fn == nullptr ? CUDA_ERROR_NOT_INITIALIZED : fn(dst, value, count, stream);
}

extern "C" CUresult CUDAAPI cuGetErrorString(CUresult error, const char** text) {
  typedef CUresult (*fn_t)(CUresult, const char**);
  fn_t fn = kspec_driver_entry<fn_t>("cuGetErrorString");
  if (fn == nullptr) {
    if (text != nullptr) *text = "the CUDA driver is not available";
    return CUDA_ERROR_NOT_INITIALIZED;
  }
  return fn(error, text);
}
"""

