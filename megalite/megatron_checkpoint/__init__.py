"""Megatron-LM checkpoints in and out of megalite (both of Megatron's formats, any layout).

    read_checkpoint(load, ckpt_format=None) -> MegatronCheckpoint   (reader.py)
    write_checkpoint(out, config, state, ...)                       (writer.py)
    load_megatron_checkpoint(...)                                   (load.py: pretrain --load)

layout.py holds what the names, args and shards mean; safe_pickle.py reads Megatron's
pickles with an allow-list.
"""
