"""Megatron-LM checkpoints in and out of megalite (both of Megatron's formats, any layout).

    read_checkpoint(load, ckpt_format=None, names=None, optimizer=True)   (reader.py)
    import_megatron(load, save, ...) -> megalite checkpoint          (convert.py)
    write_checkpoint(out, config, state, iteration, fmt, tp, pp)     (writer.py)
    load_megatron_checkpoint(...)               (load.py: pretrain_gpt.py --load)

layout.py holds what the names, args and shards mean; safe_pickle.py reads Megatron's
pickles with an allow-list; optimizer_state.py maps a legacy checkpoint's Adam state.
"""
