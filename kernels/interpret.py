"""Run this package's Triton kernels on the CPU through Triton's interpreter (tests, dry runs).

Triton reads TRITON_INTERPRET when `@triton.jit` decorates a function, and its own
language library (tl.max, tl.sum, ...) is decorated when `triton` is first imported; the
interpreter reads it again while a kernel runs. So importing this module sets the
variable for the whole process, and it only works if `triton` was not imported before:
`interpreter_ready()` tells, `load_interpreted_kernels()` refuses otherwise.

The interpreter in Triton 3.9 multiplies the raw uint16 bits of bfloat16 operands in
`tl.dot`; a small patch widens them to float32 first, which is what the GPU's bf16 MMA
with float32 accumulation computes.
"""

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

_KERNEL_MODULES = ("rng", "admission", "sequential_head", "verify_attention", "dispatch")


def interpreter_ready() -> bool:
    """True when triton's language library was loaded in interpreter mode."""
    return isinstance(tl.zeros, interpreter.InterpretedFunction)


def _bf16_as_f32(handle: "interpreter.TensorHandle") -> "interpreter.TensorHandle":
    if handle.dtype != tl.bfloat16:
        return handle
    bits = handle.data.astype(np.uint32) << 16
    return interpreter.TensorHandle(bits.view(np.float32), tl.float32)


def _patch_bf16_dot() -> None:
    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_widens_bf16", False):
        return
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, _bf16_as_f32(a), _bf16_as_f32(b), d, input_precision, max_num_imprecise_acc)

    create_dot._widens_bf16 = True
    builder.create_dot = create_dot


def load_interpreted_kernels() -> None:
    """(Re)import every kernel module in interpreter mode; afterwards CPU tensors can be launched."""
    if not interpreter_ready():
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set; "
                           "import vllm_dspark.kernels.interpret first, in a fresh process")
    _patch_bf16_dot()
    for name in _KERNEL_MODULES:
        full = f"{__package__}.{name}"
        if full in sys.modules:
            importlib.reload(sys.modules[full])
        else:
            importlib.import_module(full)
