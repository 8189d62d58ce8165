"""tools/check_cluster.py with one reduction made wrong on purpose: the gradients of the
parameters sequence parallelism replicates (the norms) averaged over the TP group where
they must be summed. Every other layout stays right; test_check_cluster.py asserts that
the check names the TP layout and only it."""

import os
import runpy

import megalite.tensor_parallel.layers as layers
from megalite.parallel_state import group_size

_sum = layers.all_reduce_anywhere


def _mean(tensor, group):
    _sum(tensor, group)
    tensor.div_(group_size(group))


layers.all_reduce_anywhere = _mean
if __name__ == "__main__":  # not in the processes a timing check starts (layout_trial.py)
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "tools", "check_cluster.py"), run_name="__main__")
