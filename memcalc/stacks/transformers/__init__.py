"""Hugging Face transformers: models by name (:mod:`~memcalc.stacks.transformers.hub`: the Hub,
a local config, the cache) and the attention implementation a model runs
(:mod:`~memcalc.stacks.transformers.attention`)."""
