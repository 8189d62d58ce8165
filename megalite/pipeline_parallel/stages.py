"""Where a model chunk sits in the pipeline (docs/design.md §5): the one place for the
arithmetic. With p pipeline ranks and v virtual stages, chunk c on rank r is global stage
c*p + r. Evenly split, it holds the L/(p*v) layers from c*L/v + r*L/(p*v); an uneven split
(`stage_layer_counts`, Megatron's --decoder-first/last-pipeline-num-layers and
--account-for-embedding/loss-in-pipeline-split) gives each global stage its own count, and
its layers follow those of the stages before it."""

from dataclasses import dataclass

from megalite.errors import ConfigError


@dataclass(frozen=True)
class Stage:
    chunk: int       # virtual stage (model chunk) on this rank
    pp_rank: int
    pp_size: int
    num_chunks: int  # v
    layer_counts: tuple[int, ...] | None = None  # per global stage; None: the even split

    @property
    def index(self) -> int:
        """The global stage: its place among the p*v stages of the whole model."""
        return self.chunk * self.pp_size + self.pp_rank

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.num_chunks

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def layers(self, num_layers: int) -> range:
        if self.layer_counts is None:
            per_chunk = num_layers // self.num_stages
            first = self.chunk * num_layers // self.num_chunks + self.pp_rank * per_chunk
            return range(first, first + per_chunk)
        if len(self.layer_counts) != self.num_stages or sum(self.layer_counts) != num_layers:
            raise ValueError(f"layer counts {self.layer_counts} do not split {num_layers} "
                             f"layers over {self.num_stages} stages")
        first = sum(self.layer_counts[:self.index])
        return range(first, first + self.layer_counts[self.index])


def rank_stages(pp_rank: int, pp_size: int, num_chunks: int,
                layer_counts: tuple[int, ...] | None = None) -> list[Stage]:
    """The stages of this pipeline rank's chunks, in chunk order."""
    return [Stage(c, pp_rank, pp_size, num_chunks, layer_counts) for c in range(num_chunks)]


def stage_layer_counts(num_layers: int, pp: int, num_chunks: int = 1,
                       first: int | None = None, last: int | None = None,
                       embedding_as_layer: bool = False,
                       loss_as_layer: bool = False) -> tuple[int, ...] | None:
    """Layers of each global stage (c*p + r), Megatron's uneven split, or None when even.

    `first` / `last` (--decoder-first/last-pipeline-num-layers) are the layers of the
    first / last pipeline rank, split evenly over its v chunks; the other ranks share the
    rest evenly. `embedding_as_layer` / `loss_as_layer`
    (--account-for-embedding/loss-in-pipeline-split) count the embedding / the output
    layer and loss as one more layer, of the first / last global stage, and split the
    L (+1) (+1) evenly over the p*v stages."""
    accounted = embedding_as_layer or loss_as_layer
    if first is None and last is None and not accounted:
        return None
    if accounted and (first is not None or last is not None):
        raise ConfigError("--account-for-embedding-in-pipeline-split and "
                          "--account-for-loss-in-pipeline-split cannot be combined with "
                          "--decoder-first-pipeline-num-layers or "
                          "--decoder-last-pipeline-num-layers (as in Megatron)")
    if pp < 2:
        raise ConfigError(f"an uneven pipeline split needs --pipeline-model-parallel-size "
                          f">= 2, got {pp}")
    if accounted:
        return _accounted_counts(num_layers, pp, num_chunks, embedding_as_layer, loss_as_layer)
    return _first_last_counts(num_layers, pp, num_chunks, first, last)


def _accounted_counts(num_layers, pp, v, embedding, loss) -> tuple[int, ...]:
    total = num_layers + embedding + loss
    if total % (pp * v):
        raise ConfigError(f"--num-layers={num_layers} + {int(embedding) + int(loss)} "
                          f"(--account-for-embedding/loss-in-pipeline-split) = {total} is "
                          f"not divisible by --pipeline-model-parallel-size={pp} x {v} "
                          f"virtual stages")
    counts = [total // (pp * v)] * (pp * v)
    counts[0] -= embedding
    counts[-1] -= loss
    return tuple(counts)


def _first_last_counts(num_layers, pp, v, first, last) -> tuple[int, ...]:
    ends = {"--decoder-first-pipeline-num-layers": first,
            "--decoder-last-pipeline-num-layers": last}
    for name, value in ends.items():
        if value is not None and (value < 0 or value % v):
            raise ConfigError(f"{name}={value} must be >= 0 and divisible by the {v} "
                              f"virtual stages per pipeline rank")
    given = {name: value for name, value in ends.items() if value is not None}
    middle_ranks = pp - len(given)
    middle = num_layers - sum(given.values())
    named = " and ".join(f"{n}={x}" for n, x in given.items())
    if middle < 0 or (middle_ranks == 0 and middle) or (
            middle_ranks and middle % (middle_ranks * v)):
        raise ConfigError(f"--num-layers={num_layers} minus {named} leaves {middle} layers, "
                          f"which do not split evenly over the other {middle_ranks} pipeline "
                          f"ranks x {v} virtual stages (--pipeline-model-parallel-size={pp})")
    per_middle = middle // (middle_ranks * v) if middle_ranks else 0
    per_rank = [per_middle] * pp
    if first is not None:
        per_rank[0] = first // v
    if last is not None:
        per_rank[-1] = last // v
    return tuple(per_rank) * v
