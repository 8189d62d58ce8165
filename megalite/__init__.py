"""megalite: Megatron-style GPT pretraining on torch.distributed, readable end to end."""
__version__ = "0.1.0"
