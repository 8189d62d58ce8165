"""Megatron-LM checkpoints in and out of megalite (both of Megatron's formats, any layout):
reader.py reads one, writer.py writes one, convert.py imports one as a megalite checkpoint,
load.py loads one directly (pretrain_gpt.py --load). layout.py holds what the names, args
and shards mean; safe_pickle.py reads Megatron's pickles with an allow-list;
optimizer_state.py maps a legacy checkpoint's Adam state.
"""
