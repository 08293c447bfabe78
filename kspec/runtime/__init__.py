"""Load compiled artifacts and launch their kernels through cuda-python.

    mod = kspec.load("out/gemm")            # works without a GPU
    out = mod.gemm_bias_relu(A, B, bias)    # -> {"D": tensor}
    args = mod.gemm_bias_relu.to_device(A=a, B=b, bias=c)   # host numpy -> device, in each spec layout

See `kspec.runtime.module` for the calling convention (streams, outputs, capture) and
`kspec.runtime.tensors` for the accepted tensor kinds.
"""
from kspec.runtime.driver import DeviceArray
from kspec.runtime.errors import KspecRuntimeError
from kspec.runtime.module import Binding, Kernel, Module, load
from kspec.runtime.tensors import DeviceBuffer
from kspec.runtime.transfer import from_device, from_numpy, to_device


def cuda_available() -> tuple[bool, str]:
    """(True, "") when cuda.bindings initialises and sees a device, else (False, why).  Never raises."""
    from kspec.runtime import driver
    return driver.get().available()


__all__ = ["load", "Module", "Kernel", "Binding", "DeviceBuffer", "DeviceArray", "from_numpy",
           "to_device", "from_device",
           "KspecRuntimeError", "cuda_available"]
