"""The keys and shapes of the last stage's legacy file of the same model at PP 2 (two gloo processes
on a CPU; run with `tied` or `untied`), as Megatron-LM's state_dict_for_save_checkpoint gives them."""
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
torch.cuda.current_device = lambda: "cpu"
torch.cuda.synchronize = lambda *a, **k: None
torch.Tensor.cuda = lambda self, *a, **k: self

def run(rank, tied):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29581")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(1, 2)
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8,
        ffn_hidden_size=64, use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, params_dtype=torch.float32,
        pipeline_model_parallel_size=2, mtp_num_layers=1, pipeline_dtype=torch.float32)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)
    m = GPTModel(cfg, spec, vocab_size=64, max_sequence_length=16, position_embedding_type="rope",
                 share_embeddings_and_output_weights=tied, mtp_block_spec=mtp,
                 pre_process=rank == 0, post_process=rank == 1)
    sd = m.state_dict_for_save_checkpoint()
    if rank == 1:
        print("TIED" if tied else "UNTIED", [(k, None if not torch.is_tensor(v) else tuple(v.shape)) for k, v in sd.items()], flush=True)
    dist.barrier()

if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1] == "tied",), nprocs=2)
