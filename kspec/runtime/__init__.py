"""Load compiled artifacts and launch their kernels through cuda-python."""
