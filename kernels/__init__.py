"""Triton kernels for DSpark verification and drafting, each with a PyTorch reference.

Import the public entry points from `vllm_dspark.kernels.dispatch`; submodules are not
imported here so that `interpret.load_interpreted_kernels` can load them in interpreter mode.
"""
