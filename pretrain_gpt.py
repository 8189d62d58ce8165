"""Pretrain a GPT model. Same flags as Megatron-LM's pretrain_gpt.py.

    python pretrain_gpt.py --mock-data --vocab-size 512 --num-layers 2 ...
    torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 ...
"""

import sys

from megalite.training import pretrain

if __name__ == "__main__":
    sys.exit(pretrain())
