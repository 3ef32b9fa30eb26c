"""TRL's trainers (``SFTTrainer``, ``DPOTrainer``): their configs read, their own ``compute_loss`` run on meta."""
