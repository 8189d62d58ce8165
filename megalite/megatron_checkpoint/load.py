"""`pretrain_gpt.py --load DIR` on a Megatron-LM save directory, without a conversion step.

Every rank reads its parameters of the checkpoint (reader.py: full single-process tensors,
only the saved stages holding its layers; Adam's state only if it loads it) and keeps its own
TP shard of each parameter (params.local_shard: the same cut as a megalite checkpoint), at
any megalite layout. The model must be the one the flags describe (the fields
model_fields.check_model_compatible compares, named when they differ). Training continues at
the saved iteration, consumed samples and learning-rate step, or at 0 with --finetune, as
in Megatron. Adam's state is carried over where it maps one to one (optimizer_state.py);
otherwise a message says the optimizer starts fresh.
"""

from megalite.checkpointing.saving import model_fields
from megalite.checkpointing.state import CheckpointState, canonical_name, state_buffers
from megalite.checkpointing.model_fields import MODEL_FIELDS, check_model_compatible
from megalite.errors import CheckpointError
from megalite.megatron_checkpoint.optimizer_state import adam_state
from megalite.megatron_checkpoint.reader import MegatronCheckpoint, read_checkpoint
from megalite.parallel_state import print_rank_0


def check_compatible(ckpt: MegatronCheckpoint, model_config) -> None:
    """Refuses a checkpoint of another model, naming the differing fields. Megatron's args
    record the padded vocabulary but not always the tokenizer's: then only the rows must
    hold this run's vocabulary."""
    fields = MODEL_FIELDS
    if ckpt.config.vocab_size is None:
        fields = tuple(f for f in MODEL_FIELDS if f != "vocab_size")
        vocab = model_config.vocab_size or model_config.padded_vocab_size
        if vocab > ckpt.config.padded_vocab_size:
            raise CheckpointError(f"Megatron checkpoint {ckpt.directory} has "
                                  f"{ckpt.config.padded_vocab_size} vocabulary rows, fewer "
                                  f"than this run's vocabulary of {vocab}")
    check_model_compatible(model_fields(ckpt.config), model_fields(model_config), fields,
                           checkpoint=ckpt.directory)


def load_megatron_checkpoint(load: str, ckpt: CheckpointState) -> dict:
    """loading.load_checkpoint's counterpart for a Megatron directory: same return."""
    finetune = ckpt.config.checkpoint.finetune
    load_optim = ckpt.config.checkpoint.load_optim and not finetune
    # Only this rank's parameters (its stages' layers) and, if it keeps them, Adam's.
    names = {canonical_name(n, p) for n, p in ckpt.chunks.named_parameters()}
    names |= set(state_buffers(ckpt.chunks, chunk_prefix=False))  # a MoE router's expert bias
    megatron = read_checkpoint(load, names=names, optimizer=load_optim)
    check_compatible(megatron, ckpt.config.model)
    ckpt.load_params(lambda name: megatron.state[name])
    if load_optim:
        _load_optimizer(megatron, ckpt)
    if finetune:
        return {"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0}
    ckpt.scheduler.load_state_dict({"num_steps": megatron.scheduler_steps})
    return {"iteration": megatron.iteration, "consumed_train_samples": megatron.consumed("train"),
            "consumed_valid_samples": megatron.consumed("valid")}


def _load_optimizer(megatron: MegatronCheckpoint, ckpt: CheckpointState) -> None:
    adam, reason = adam_state(megatron)
    if adam is None:
        print_rank_0(f" > {megatron.directory}: {reason}; the optimizer starts fresh (Adam "
                     f"moments zero, step 0)")
        return
    ckpt.load_optimizer(adam.step, lambda name, k: adam.tensors[name][k])
    print_rank_0(f" > {megatron.directory}: Adam state carried over (step {adam.step})")
