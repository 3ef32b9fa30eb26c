"""bitsandbytes, emulated on meta tensors without importing it: a quantized base
(:mod:`~memcalc.stacks.bitsandbytes.quantized_base`: 4-bit and 8-bit ``Linear`` weights as
bitsandbytes stores and dequantizes them) and its 8-bit and paged AdamW
(:mod:`~memcalc.stacks.bitsandbytes.adamw`, registered as memcalc optimizers on import). Each
kernel is a ``memcalc::`` operator with its cost rule beside it (:mod:`memcalc.engine.kernel_ops`).
"""

from memcalc.stacks.bitsandbytes import adamw as adamw  # registers adamw-8bit, paged-adamw-8bit, paged-adamw-32bit
