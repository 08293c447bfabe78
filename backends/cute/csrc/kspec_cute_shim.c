/* kspec's implementation of the eight CUDA wrapper symbols that a CuTe DSL `export_to_c` object
 * leaves undefined (_cudaLibraryLoadData, _cudaLibraryGetKernel, _cudaLaunchKernelEx,
 * _cudaFuncSetAttribute, _cudaKernelSetAttributeForDevice, _cudaGetDevice, _cudaDeviceGetAttribute,
 * _cuKernelGetAttribute).
 *
 * They run the DSL's host launcher in *capture* mode: nothing touches a driver.  The launcher
 * builds its TMA descriptors and kernel arguments in host code and "launches"; the launch records
 * grid, block, cluster, dynamic shared memory and the argument bytes (packed at the kernel's
 * parameter offsets, taken from the PTX at build time) into the caller's parameter blob.  kspec's
 * runtime then launches the cubin itself with cuLaunchKernelEx, exactly like a CUTLASS C++ kernel
 * (backends/ABI.md, "CuTe DSL kernels").
 *
 * The structures below mirror the CUDA runtime's public ABI (driver_types.h, CUDA 12/13):
 * cudaLaunchConfig_t and cudaLaunchAttribute.  tests/test_cute_backend.py compiles this file
 * against the real headers with static assertions when they are present.
 *
 * Part of kspec (Apache-2.0).  Depends only on libc.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <stdio.h>

typedef int kspec_cuda_error;     /* cudaError_t / CUresult: 0 is success */
enum { KS_OK = 0, KS_ERR_INVALID_VALUE = 1, KS_ERR_NOT_SUPPORTED = 801 };

typedef struct { unsigned int x, y, z; } kspec_dim3;
typedef struct {
    int id;
    char pad[4];
    union { char pad[64]; struct { unsigned int x, y, z; } clusterDim; } val;
} kspec_launch_attribute;
typedef struct {
    kspec_dim3 gridDim;
    kspec_dim3 blockDim;
    size_t dynamicSmemBytes;
    void *stream;
    kspec_launch_attribute *attrs;
    unsigned int numAttrs;
} kspec_launch_config;

enum { KS_ATTR_CLUSTER_DIMENSION = 4 };               /* cudaLaunchAttributeClusterDimension */
enum { KS_FUNC_ATTR_MAX_DYNAMIC_SMEM = 8 };            /* cudaFuncAttributeMaxDynamicSharedMemorySize */
enum { KS_DEV_ATTR_SM_COUNT = 16 };                    /* cudaDevAttrMultiProcessorCount */
enum { KS_DEV_ATTR_SMEM_OPTIN = 97 };                  /* cudaDevAttrMaxSharedMemoryPerBlockOptin */

/* One capture per thread: kspec_prepare is reentrant across threads. */
typedef struct {
    int active;
    int device;
    int sm_count;
    int smem_optin;
    const char *expect_kernel;          /* entry point name the launcher must ask for */
    const uint32_t *param_offset;       /* per kernel parameter, from the PTX */
    const uint32_t *param_size;
    int num_params;
    unsigned char *params;
    uint64_t params_cap;
    uint64_t params_size;
    uint32_t grid[3], block[3], cluster[3];
    uint32_t smem;
    int launches;
    char err[256];
} kspec_capture;

static __thread kspec_capture ks_cap;
static const char ks_library_tag = 'L';   /* address used as the fake library handle */
static const char ks_kernel_tag = 'K';    /* address used as the fake kernel handle */

static kspec_cuda_error ks_fail(const char *msg) {
    if (!ks_cap.err[0]) snprintf(ks_cap.err, sizeof ks_cap.err, "%s", msg);
    return KS_ERR_NOT_SUPPORTED;
}

void kspec_capture_begin(int device, int sm_count, int smem_optin, const char *expect_kernel, const uint32_t *param_offset,
                         const uint32_t *param_size, int num_params, void *params, uint64_t params_cap) {
    memset(&ks_cap, 0, sizeof ks_cap);
    ks_cap.active = 1;
    ks_cap.device = device;
    ks_cap.sm_count = sm_count;
    ks_cap.smem_optin = smem_optin;
    ks_cap.expect_kernel = expect_kernel;
    ks_cap.param_offset = param_offset;
    ks_cap.param_size = param_size;
    ks_cap.num_params = num_params;
    ks_cap.params = (unsigned char *)params;
    ks_cap.params_cap = params_cap;
    ks_cap.cluster[0] = ks_cap.cluster[1] = ks_cap.cluster[2] = 1;
}

/* Returns 0 when exactly one launch was captured; else nonzero with a message in err. */
int kspec_capture_end(uint64_t *params_size, uint32_t grid[3], uint32_t block[3], uint32_t cluster[3],
                      uint32_t *smem, char *err, uint64_t err_cap) {
    int rc = 0;
    ks_cap.active = 0;
    if (!ks_cap.err[0] && ks_cap.launches != 1)
        snprintf(ks_cap.err, sizeof ks_cap.err, "the CuTe DSL launcher made %d launches (expected 1)",
                 ks_cap.launches);
    if (ks_cap.err[0]) {
        if (err && err_cap) snprintf(err, (size_t)err_cap, "%s", ks_cap.err);
        return 1;
    }
    *params_size = ks_cap.params_size;
    for (int i = 0; i < 3; ++i) {
        grid[i] = ks_cap.grid[i];
        block[i] = ks_cap.block[i];
        cluster[i] = ks_cap.cluster[i];
    }
    *smem = ks_cap.smem;
    return rc;
}

kspec_cuda_error _cudaLibraryLoadData(void **library, const void *code, void *jit_options, void **jit_values,
                                      unsigned int num_jit, void *lib_options, void **lib_values,
                                      unsigned int num_lib) {
    (void)code; (void)jit_options; (void)jit_values; (void)num_jit; (void)lib_options; (void)lib_values;
    (void)num_lib;
    if (!ks_cap.active) return ks_fail("CuTe DSL launcher called outside kspec_prepare");
    *library = (void *)&ks_library_tag;
    return KS_OK;
}

kspec_cuda_error _cudaLibraryGetKernel(void **kernel, void *library, const char *name) {
    if (!ks_cap.active) return ks_fail("CuTe DSL launcher called outside kspec_prepare");
    if (library != (void *)&ks_library_tag) return ks_fail("unknown library handle");
    if (ks_cap.expect_kernel && strcmp(name, ks_cap.expect_kernel) != 0)
        return ks_fail("the launcher asked for a kernel other than the artifact's entry point");
    *kernel = (void *)&ks_kernel_tag;
    return KS_OK;
}

kspec_cuda_error _cudaFuncSetAttribute(const void *func, int attr, int value) {
    if (!ks_cap.active) return ks_fail("CuTe DSL launcher called outside kspec_prepare");
    (void)func;
    if (attr == KS_FUNC_ATTR_MAX_DYNAMIC_SMEM && value >= 0) ks_cap.smem = (uint32_t)value;
    return KS_OK;
}

kspec_cuda_error _cudaKernelSetAttributeForDevice(void *kernel, int attr, int value, int device) {
    (void)device;
    return _cudaFuncSetAttribute(kernel, attr, value);
}

kspec_cuda_error _cudaGetDevice(int *device) {
    if (!ks_cap.active) return ks_fail("CuTe DSL launcher called outside kspec_prepare");
    *device = ks_cap.device;
    return KS_OK;
}

kspec_cuda_error _cudaDeviceGetAttribute(int *value, int attr, int device) {
    (void)device;
    if (!ks_cap.active) return ks_fail("CuTe DSL launcher called outside kspec_prepare");
    if (attr == KS_DEV_ATTR_SM_COUNT) {
        *value = ks_cap.sm_count;
        return KS_OK;
    }
    if (attr == KS_DEV_ATTR_SMEM_OPTIN) {
        *value = ks_cap.smem_optin;   /* the target arch's value, fixed per arch */
        return KS_OK;
    }
    char msg[96];
    snprintf(msg, sizeof msg, "the CuTe DSL launcher queried device attribute %d, unknown to kspec", attr);
    return ks_fail(msg);
}

kspec_cuda_error _cuKernelGetAttribute(int *value, int attr, void *kernel, int device) {
    (void)kernel; (void)device; (void)attr;
    if (!ks_cap.active) return ks_fail("CuTe DSL launcher called outside kspec_prepare");
    /* Queried attributes are reported as 0 ("no limit recorded"): the runtime sets the real
     * dynamic shared memory size itself before the launch. */
    *value = 0;
    return KS_OK;
}

kspec_cuda_error _cudaLaunchKernelEx(const kspec_launch_config *config, const void *func, void **args) {
    if (!ks_cap.active) return ks_fail("CuTe DSL launcher called outside kspec_prepare");
    if (func != (const void *)&ks_kernel_tag) return ks_fail("launch of an unknown kernel handle");
    ks_cap.launches += 1;
    if (ks_cap.launches > 1) return ks_fail("the CuTe DSL launcher launched more than one kernel");
    ks_cap.grid[0] = config->gridDim.x; ks_cap.grid[1] = config->gridDim.y; ks_cap.grid[2] = config->gridDim.z;
    ks_cap.block[0] = config->blockDim.x; ks_cap.block[1] = config->blockDim.y; ks_cap.block[2] = config->blockDim.z;
    /* the launch's own dynamic shared memory, not the opt-in maximum the launcher may have set */
    ks_cap.smem = (uint32_t)config->dynamicSmemBytes;
    for (unsigned int i = 0; i < config->numAttrs; ++i) {
        const kspec_launch_attribute *a = &config->attrs[i];
        if (a->id == KS_ATTR_CLUSTER_DIMENSION) {
            ks_cap.cluster[0] = a->val.clusterDim.x;
            ks_cap.cluster[1] = a->val.clusterDim.y;
            ks_cap.cluster[2] = a->val.clusterDim.z;
        }
    }
    uint64_t end = 0;
    for (int i = 0; i < ks_cap.num_params; ++i) {
        uint64_t e = (uint64_t)ks_cap.param_offset[i] + ks_cap.param_size[i];
        if (e > end) end = e;
    }
    if (end > ks_cap.params_cap) return ks_fail("kernel parameters exceed the parameter buffer");
    memset(ks_cap.params, 0, (size_t)end);
    for (int i = 0; i < ks_cap.num_params; ++i)
        memcpy(ks_cap.params + ks_cap.param_offset[i], args[i], ks_cap.param_size[i]);
    ks_cap.params_size = end;
    return KS_OK;
}
