"""A tiny dense GPT with one MTP depth written by Megatron-LM itself (CPU, local spec)."""
import os, contextlib, argparse, shutil, torch, torch.distributed as dist
torch.cuda.current_device = lambda: "cpu"
torch.cuda.synchronize = lambda *a, **k: None


def main():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29577")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps, tensor_parallel, dist_checkpointing
    ps.initialize_model_parallel(1, 1)
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    torch.manual_seed(7)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8,
        ffn_hidden_size=64, use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=False, params_dtype=torch.float32, perform_initialization=True,
        mtp_num_layers=1, mtp_loss_scaling_factor=0.1)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)
    m = GPTModel(cfg, spec, vocab_size=64, max_sequence_length=16, position_embedding_type="rope",
                 share_embeddings_and_output_weights=False, mtp_block_spec=mtp)
    m.eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 1: p.uniform_(0.5, 1.5)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    sequence = torch.tensor([[5, 17, 42, 8, 59, 3, 14, 1, 2, 20, 37, 31, 9, 0, 56, 11, 44]])
    tokens, labels = sequence[:, :-1], sequence[:, 1:]
    pos = torch.arange(tokens.shape[1]).unsqueeze(0)
    mask = torch.triu(torch.ones(16, 16), diagonal=1).bool()[None, None]
    with torch.no_grad():
        logits = m(tokens, pos, attention_mask=mask)
    # A training forward with labels: the MTP depth's token-mean loss, as Megatron logs it
    # (MTPLossLoggingHelper's tracker; dropout is 0, so the weights act as in eval).
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    m.train()
    with torch.no_grad():
        lm_losses = m(tokens, pos, attention_mask=mask, labels=labels)
    mtp_loss = MTPLossLoggingHelper.tracker["loss_values"].clone()
    m.eval()
    out = os.environ["OUT"]; os.makedirs(out, exist_ok=True)
    torch.save({"tokens": tokens, "logits": logits, "sequence": sequence, "lm_losses": lm_losses,
                "mtp_loss": mtp_loss}, out + "/reference_logits.pt")
    print("mtp loss", mtp_loss, "lm", lm_losses.mean())
    print("logits", tuple(logits.shape))
    ns = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope",
        rotary_base=10000, rotary_percent=1.0,
        norm_epsilon=1e-5, untie_embeddings_and_output_weights=True, padded_vocab_size=64, seq_length=16,
        max_position_embeddings=16, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        kv_channels=8, params_dtype=torch.float32, mtp_num_layers=1, mtp_loss_scaling_factor=0.1)
    d = out + "/torch_dist/iter_0000010"; shutil.rmtree(out + "/torch_dist", ignore_errors=True); os.makedirs(d)
    dist_checkpointing.save({"model": m.sharded_state_dict(), "iteration": 10, "checkpoint_version": 3.0, "args": ns}, d)
    open(out + "/torch_dist/latest_checkpointed_iteration.txt", "w").write("10")
    d = out + "/torch/iter_0000010/mp_rank_00"; os.makedirs(d, exist_ok=True)
    sd = m.state_dict_for_save_checkpoint()
    torch.save({"model": sd, "iteration": 10, "checkpoint_version": 3.0, "args": ns}, d + "/model_optim_rng.pt")
    open(out + "/torch/latest_checkpointed_iteration.txt", "w").write("10")
    print("keys", [k for k in sd if k.startswith("mtp")])

if __name__ == "__main__":
    main()
