"""Where a model chunk sits in the pipeline (docs/design.md §5): the one place for the
arithmetic. With p pipeline ranks and v virtual stages, chunk c on rank r is global stage
c*p + r and holds the L/(p*v) layers from c*L/v + r*L/(p*v)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    chunk: int       # virtual stage (model chunk) on this rank
    pp_rank: int
    pp_size: int
    num_chunks: int  # v

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
        per_chunk = num_layers // self.num_stages
        first = self.chunk * num_layers // self.num_chunks + self.pp_rank * per_chunk
        return range(first, first + per_chunk)


def rank_stages(pp_rank: int, pp_size: int, num_chunks: int) -> list[Stage]:
    """The stages of this pipeline rank's chunks, in chunk order."""
    return [Stage(c, pp_rank, pp_size, num_chunks) for c in range(num_chunks)]
