"""Launch configurations read into an estimate: accelerate's config file (``accelerate launch
--config_file``) and a DeepSpeed JSON (``--deepspeed``). Each becomes a :class:`LaunchSetup`:
the multi-GPU setting (:class:`~memcalc.distributed.setting.Distributed`'s keywords), the step's
options it decides (precision, checkpointing, batch, accumulation) and notes. The table of what
each key becomes is docs/launch-configs.md."""
