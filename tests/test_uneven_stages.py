"""Uneven pipeline stages without launching ranks (issue 29): Megatron's layer split per
stage for its flags, the errors that name them, the planner per stage, and the simulator's
bubble with the embedding and the loss counted as work (docs/design.md §15)."""

from fractions import Fraction

import pytest

from megalite import memory_estimate as me
from megalite.arguments import parse_args
from megalite.errors import ConfigError
from megalite.model.gpt import GPTModel
from megalite.pipeline_parallel.schedules import build_schedule
from megalite.pipeline_parallel.simulate import simulate, stage_work
from megalite.pipeline_parallel.stages import rank_stages, stage_layer_counts
from megalite.validation import validate_args

from tests.helpers import flags_with


def config_of(*extra, layers=8, world_size=4):
    flags = flags_with(*extra, num_layers=layers, micro_batch_size=1, global_batch_size=8)
    return validate_args(parse_args(flags), world_size)


# Megatron's get_num_layers_to_build / get_transformer_layer_offset, worked by hand:
# (L, p, v, flags) -> layers of global stage c*p + r.
@pytest.mark.parametrize("layers, pp, v, kwargs, counts", [
    (8, 4, 1, dict(first=1, last=1), (1, 3, 3, 1)),
    (8, 4, 1, dict(first=2), (2, 2, 2, 2)),
    (7, 2, 1, dict(first=3), (3, 4)),
    (6, 4, 1, dict(first=0, last=2), (0, 2, 2, 2)),
    (12, 4, 2, dict(first=2, last=2), (1, 2, 2, 1, 1, 2, 2, 1)),
    (6, 4, 1, dict(embedding_as_layer=True, loss_as_layer=True), (1, 2, 2, 1)),
    (7, 2, 2, dict(embedding_as_layer=True), (1, 2, 2, 2)),
])
def test_megatron_split(layers, pp, v, kwargs, counts):
    assert stage_layer_counts(layers, pp, v, **kwargs) == counts
    # Each rank's chunks hold consecutive runs of the global layer order, all covered once.
    held = sorted(i for r in range(pp) for s in rank_stages(r, pp, v, counts)
                  for i in s.layers(layers))
    assert held == list(range(layers))


def test_flags_reach_the_config():
    c = config_of("--pipeline-model-parallel-size", "4",
                  "--decoder-first-pipeline-num-layers", "2",
                  "--decoder-last-pipeline-num-layers", "2",
                  "--num-virtual-stages-per-pipeline-rank", "2", layers=12)
    assert c.parallel.pipeline_layer_counts == (1, 2, 2, 1, 1, 2, 2, 1)
    assert c.parallel.virtual_pipeline_model_parallel_size == 2
    assert config_of("--pipeline-model-parallel-size", "4").parallel.pipeline_layer_counts is None


@pytest.mark.parametrize("extra, words", [
    (["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "3"],
     ["--num-layers=8", "--decoder-first-pipeline-num-layers=3", "leaves 5 layers",
      "--pipeline-model-parallel-size=4"]),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3",
      "--decoder-last-pipeline-num-layers", "3"],
     ["--decoder-last-pipeline-num-layers=3", "leaves 2 layers"]),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3",
      "--num-virtual-stages-per-pipeline-rank", "2"],
     ["--decoder-first-pipeline-num-layers=3", "divisible by the 2 virtual stages"]),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2",
      "--num-layers-per-virtual-pipeline-stage", "1"],
     ["--num-virtual-stages-per-pipeline-rank", "not --num-layers-per-virtual-pipeline-stage"]),
    (["--pipeline-model-parallel-size", "4", "--account-for-embedding-in-pipeline-split"],
     ["--num-layers=8 + 1", "= 9", "--pipeline-model-parallel-size=4"]),
    (["--pipeline-model-parallel-size", "2", "--account-for-loss-in-pipeline-split",
      "--decoder-first-pipeline-num-layers", "2"],
     ["--account-for-loss-in-pipeline-split", "--decoder-first-pipeline-num-layers"]),
    (["--decoder-last-pipeline-num-layers", "2"], ["--pipeline-model-parallel-size >= 2"]),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tL"],
     ["--pipeline-model-parallel-layout is not implemented"]),
])
def test_bad_splits_name_the_flags(extra, words):
    world = int(extra[extra.index("--pipeline-model-parallel-size") + 1]) \
        if "--pipeline-model-parallel-size" in extra else 1
    with pytest.raises(ConfigError) as err:
        config_of(*extra, world_size=world)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_planner_counts_each_stages_own_layers():
    c = config_of("--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers",
                  "1", "--decoder-last-pipeline-num-layers", "1")
    whole = dict(GPTModel(c.model, 1).named_parameters())

    def numel(prefixes):
        return sum(p.numel() for n, p in whole.items() if n.startswith(prefixes))
    layer = numel(("decoder.layers.0.",))
    planned = [sum(p.numel() for p in me.rank_parameters(c, r)) for r in range(4)]
    # 1, 3, 3, 1 layers; the embedding on the first stage, the final norm on the last and,
    # tied, a copy of the embedding as the output layer.
    embedding, norm = numel(("embedding.",)), numel(("decoder.final_layernorm",))
    word = whole["embedding.word_embeddings.weight"].numel()
    assert planned == [embedding + layer, 3 * layer, 3 * layer, layer + norm + word]


def _sim(p, m, counts, embedding, loss, schedule="1f1b"):
    schedules = [build_schedule(p, r, m, 1, schedule) for r in range(p)]
    return simulate(schedules, 1, 1, 2, 0, work_per_stage=stage_work(counts, embedding, loss))


def test_uniform_work_gives_the_closed_form_bubble():
    sim = _sim(4, 8, (2, 2, 2, 2), 0, 0)
    assert sim.idle_fraction == sim.bubble_fraction == Fraction(3, 8)


def test_uneven_stages_balance_an_embedding_and_loss_heavy_model():
    """Embedding and loss each worth 2 layers: 2 2 2 2 layers leave the end stages at 4 of
    work and the middle at 2; 1 3 3 1 gives every stage 3, the work of 12 / 4."""
    even, uneven = _sim(4, 8, (2, 2, 2, 2), 2, 2), _sim(4, 8, (1, 3, 3, 1), 2, 2)
    assert even.total_busy == uneven.total_busy
    # Balanced: each of m=8 micro-batches costs 3 x (F 1 + B 2) per stage, and the 1F1B
    # bubble adds (p-1) of them: (8 + 3) x 9.
    assert uneven.makespan == (8 + 3) * 9
    assert uneven.idle_fraction == Fraction(3, 8)
    assert even.makespan > uneven.makespan and even.idle_fraction > uneven.idle_fraction
