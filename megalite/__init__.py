"""megalite: Megatron-style GPT pretraining on torch.distributed, readable end to end."""
