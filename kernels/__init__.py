"""CuTe DSL SM90 kernels, one family per module, each with its NumPy reference; `kernels.build` compiles them."""
