"""The third-party libraries a training step is built with, each in a room of its own, so that
the engine stays library-agnostic: Hugging Face transformers (:mod:`memcalc.stacks.transformers`:
models by name from the Hub or a config, and their attention implementations), PEFT
(:mod:`memcalc.stacks.peft`: fine-tuning as people do it, LoRA by the real ``peft``) and
bitsandbytes (:mod:`memcalc.stacks.bitsandbytes`: a quantized base and 8-bit / paged AdamW,
emulated without importing it). A library that runs on meta tensors is run; one that cannot is
emulated from its source, cited per rule.

A library's optimizers join the engine's registry (:func:`memcalc.engine.optimizers.register_optimizer`)
when its room is imported; importing :mod:`memcalc.stacks` registers bitsandbytes', so that every
layer above the engine finds them by name.
"""

from memcalc.stacks import bitsandbytes as bitsandbytes  # registers bitsandbytes' optimizers
