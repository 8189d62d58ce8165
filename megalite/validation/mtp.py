"""Multi-token prediction's flags (--mtp-num-layers, --mtp-loss-scaling-factor): what the MTP
modules cannot run with (docs/design.md §33)."""

from megalite.errors import ConfigError


def check_mtp(args):
    """Raises ConfigError for an MTP combination megalite (or Megatron) does not build."""
    depths = args.mtp_num_layers
    if depths is None:
        return
    if depths < 1:
        raise ConfigError(f"--mtp-num-layers must be >= 1 (unset for no MTP), got {depths}")
    if args.mtp_loss_scaling_factor < 0:
        raise ConfigError(f"--mtp-loss-scaling-factor must be >= 0, got "
                          f"{args.mtp_loss_scaling_factor}")
    if args.position_embedding_type != "rope":
        # Megatron's rule: the MTP modules share the main model's RoPE table.
        raise ConfigError(f"--mtp-num-layers needs --position-embedding-type rope, not "
                          f"{args.position_embedding_type} (as in Megatron)")
    documents = [f"--{name.replace('_', '-')}" for name in
                 ("reset_position_ids", "reset_attention_mask",
                  "dataloader_inter_document_masking") if getattr(args, name)]
    if documents:
        # The targets k ahead are rolled over the whole sample, across document ends.
        raise ConfigError(f"--mtp-num-layers with {', '.join(documents)} is not supported: the "
                          "MTP targets are shifted over the whole sample, not per document")
    if args.fp8_format is not None:
        raise ConfigError("--mtp-num-layers with --fp8-format is not supported: the MTP "
                          "layers have no FP8 recipe")
    if depths >= args.seq_length:
        raise ConfigError(f"--mtp-num-layers={depths} leaves no position to predict in "
                          f"--seq-length={args.seq_length}")
