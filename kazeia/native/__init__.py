"""Native code: C compiled on this machine and called through ctypes.

`build.py` builds and loads the library (`library()`: None where it cannot be used, the eager code
then runs); `step.py` is the decoding step of a decoder stack with the glue between its products in
C (`stack_step`); `linear.py` the float GEMV's product kind. The kernels are the `.c` files here:
decode.c and stack.c (a decoding step's glue and a whole step), gemv.c, int8.c and int4.c (the
talker's products), conv.c, conv8.c (int8) and vocoder.c (the vocoder's products and its value-by-value layers).
"""

from .build import SOURCES, build, cache_dir, enabled, flags, library, reset
from .step import MAX_POSITIONS, StackStep, stack_step

__all__ = [
    "SOURCES",
    "build",
    "cache_dir",
    "enabled",
    "flags",
    "library",
    "reset",
    "MAX_POSITIONS",
    "StackStep",
    "stack_step",
]
