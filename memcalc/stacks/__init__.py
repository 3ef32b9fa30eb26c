"""The third-party libraries a training step is built with, each in a room of its own, so that
the engine stays library-agnostic: Hugging Face transformers (:mod:`memcalc.stacks.transformers`:
models by name from the Hub or a config, and their attention implementations), PEFT
(:mod:`memcalc.stacks.peft`: fine-tuning as people do it, LoRA by the real ``peft``) and
bitsandbytes (:mod:`memcalc.stacks.bitsandbytes`: a quantized base, emulated without importing
it). A library that runs on meta tensors is run; one that cannot is emulated from its source,
cited per rule.

bitsandbytes' 8-bit and paged AdamW stay in the engine (:mod:`memcalc.engine.optimizers_bnb`):
the engine's table of optimizers (:mod:`memcalc.engine.optimizers`) names them, and the engine
imports no layer above it.
"""
