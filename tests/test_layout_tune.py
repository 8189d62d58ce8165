"""megalite/layout_tune.py against closed forms: the message sizes of a layout (what the
cluster check measures bandwidth at), the candidate layouts, the pruning rule; and the
cluster check's report with and without matplotlib, and the memory it plans for."""

import sys
import types

import pytest
import torch

from megalite.arguments import parse_args
from megalite.cluster_check.report import Section, write_report
from megalite.cluster_check.tuning import device_capacity
from megalite.errors import ConfigError
from megalite.layout_tune import (Candidate, Estimate, algorithm_factor, candidates,
                                  communication_seconds, nearest_bandwidth, prune_by_bandwidth,
                                  step_traffic)
from megalite.validation import validate_args

from tests.helpers import load_tool

# V = 61, h = 64, L = 4, 8 heads in 4 groups (kv width 32), SwiGLU f = 96, s = 32, no
# biases: a layer holds 2h (norms) + h(h + 2*32) (QKV) + h^2 (proj) + 2hf (fc1) + fh (fc2).
MODEL = ["--mock-data", "--vocab-size", "61", "--make-vocab-size-divisible-by", "1",
         "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
         "--group-query-attention", "--num-query-groups", "4", "--swiglu",
         "--ffn-hidden-size", "96", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--seq-length", "32", "--disable-bias-linear",
         "--lr", "1e-3", "--train-iters", "10"]
V, H, S, F = 61, 64, 32, 96
LAYER = 2 * H + H * (H + 2 * 32) + H * H + 2 * H * F + F * H


def config(world: int, *flags, micro: int = 2, global_batch: int = 16):
    return validate_args(parse_args(MODEL + ["--micro-batch-size", str(micro),
                                             "--global-batch-size", str(global_batch),
                                             *flags]), world)


def by_what(cfg) -> dict:
    return {msg.what: msg for msg in step_traffic(cfg)}


def test_data_parallel_messages_are_the_gradient_buckets():
    # The tied embedding has a bucket of its own (grad_buffer); the layers and the final
    # norm share the other, fp32 gradients.
    msgs = by_what(config(4))
    assert msgs["DP gradient buckets"].size == 4 * (4 * LAYER + H)
    assert (msgs["DP gradient buckets"].op, msgs["DP gradient buckets"].count) == ("all-reduce", 2)
    zero1 = by_what(config(4, "--use-distributed-optimizer"))
    assert zero1["ZeRO-1 gradient buckets"].op == "reduce-scatter"
    assert zero1["ZeRO-1 parameter gather"].size == 4 * (4 * LAYER + H)


def test_fsdp2_gathers_a_layer_per_unit():
    for strategy, gathers in (("optim_grads_params", 2), ("optim_grads", 1)):
        msgs = by_what(config(4, "--use-torch-fsdp2", "--data-parallel-sharding-strategy",
                              strategy))
        gather = msgs["FSDP2 unit gather"]
        # The largest unit is a layer; the 4 layers and the root (the tied embedding and
        # the final norm) are gathered.
        assert (gather.size, gather.count) == (4 * LAYER, gathers * 5), strategy


def test_tp_pp_cp_messages_are_the_activations():
    micro = 2
    msgs = by_what(config(8, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--pipeline-model-parallel-size", "2", micro=micro))
    # 16 sequences / (micro 2 x DP 2) = 4 micro-batches; 2 layers a stage.
    assert msgs["TP activations"].size == micro * S * H * 4
    assert msgs["TP activations"].count == 2 * 4 * 4
    assert msgs["PP activations"].size == micro * S * H * 4 // 2  # the SP shard
    assert msgs["PP activations"].count == 2 * 4
    cp = by_what(config(2, "--context-parallel-size", "2", micro=micro))
    # One K or V chunk: micro x s/CP x 4 groups x 8 channels.
    assert cp["CP K/V (p2p)"].size == micro * S // 2 * 32 * 4


def test_algorithm_factors_are_nccl_tests():
    assert algorithm_factor("all-reduce", 4) == 1.5
    assert algorithm_factor("all-gather", 4) == algorithm_factor("reduce-scatter", 4) == 0.75
    assert algorithm_factor("p2p", 2) == 1.0


def test_communication_time_is_bytes_over_bus_bandwidth():
    cfg = config(4)
    # 2 all-reduces of the buckets (4 * LAYER and 4 * V * H bytes: padded to DP) at 1 GB/s.
    seconds = communication_seconds(cfg, lambda op, size: 1.0)
    expected = sum(2 * 3 / 4 * msg.size * msg.count for msg in step_traffic(cfg)) / 1e9
    assert seconds == pytest.approx(expected)
    busbw = nearest_bandwidth({("all-reduce", 1000): 1.0, ("all-reduce", 10 ** 6): 5.0})
    assert busbw("all-reduce", 2000) == 1.0 and busbw("all-reduce", 5 * 10 ** 5) == 5.0


def test_a_layout_whose_communication_exceeds_the_best_step_is_dropped():
    def estimate(name, compute, communication):
        return Estimate(Candidate(name, (), config(1)), compute, communication)
    best, slow_compute, chatty = estimate("a", 1.0, 0.5), estimate("b", 3.0, 0.1), \
        estimate("c", 0.1, 1.6)
    kept, dropped = prune_by_bandwidth([chatty, slow_compute, best])
    assert [e.candidate.name for e in kept] == ["a", "b"]
    assert [e.candidate.name for e in dropped] == ["c"]


def test_candidates_take_the_least_recompute_that_fits():
    lean, valid = candidates(MODEL, 4, 16, lambda cfg: True)
    assert lean and valid == len(lean)
    assert not any("selective" in c.name or "full" in c.name for c in lean)
    names = {c.name for c in lean}
    assert {"DP4, micro-batch 1", "TP2 x DP2 ZeRO-1, micro-batch 2",
            "PP2 (v2) x DP2 FSDP2 optim_grads, micro-batch 4", "CP4, micro-batch 1"} <= names
    # Nothing fits without recompute: every layout gets the selective kind.
    recomputed, _ = candidates(MODEL, 4, 16,
                               lambda cfg: cfg.model.recompute_granularity is not None)
    assert len(recomputed) == len(lean)
    assert all(c.name.split(",")[0].endswith(" selective") for c in recomputed)
    for c in lean:  # each candidate is the config of its own flags
        assert validate_args(parse_args(MODEL + list(c.flags)), 4) == c.config


CHARTS = {"scaling.png": [(1, 1.0), (2, 0.93), (4, 0.85)],
          "busbw.png": {("all-reduce", 1024): 0.1, ("all-reduce", 2 ** 20): 2.0,
                        ("p2p", 1024): 0.2, ("p2p", 2 ** 20): 3.0}}


def test_the_report_without_matplotlib_says_why_there_are_no_charts(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    write_report(str(tmp_path), [Section("A check", ["a line"])], CHARTS, ["head"])
    report = (tmp_path / "REPORT.md").read_text()
    assert "Charts skipped: matplotlib is not installed; `pip install -e .[plot]`" in report
    assert "## A check" in report and not list(tmp_path.glob("*.png"))


def test_the_report_with_matplotlib_links_both_charts(tmp_path):
    pytest.importorskip("matplotlib")
    write_report(str(tmp_path), [], CHARTS, ["head"])
    report = (tmp_path / "REPORT.md").read_text()
    for name in CHARTS:
        assert f"]({name})" in report
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["REPORT.md", "busbw.png",
                                                          "scaling.png"]


def test_tune_plans_against_a_fraction_of_each_ranks_memory(monkeypatch):
    tool = load_tool("check_cluster")
    args = tool.build_parser().parse_args(["--output-dir", "out"])
    assert args.memory_fraction == 0.9
    # A GPU of 80 GiB: the CUDA context, NCCL's buffers and fragmentation get the rest.
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=80 * 2 ** 30))
    assert device_capacity(torch.device("cuda", 0), 8, 0.9) == int(0.9 * 80 * 2 ** 30)
    # A CPU: the host's memory (the kernel's MemTotal) split over the node's ranks.
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert device_capacity(torch.device("cpu"), 4, 0.5) == int(0.5 * (total // 2))
    for bad in ("0", "1.5"):
        with pytest.raises(ConfigError, match=f"--memory-fraction must be in \\(0, 1\\], "
                           f"got {bad}"):
            tool.check_flags(tool.build_parser().parse_args(["--output-dir", "out",
                                                              "--memory-fraction", bad]), 1)


def _wire_bytes(cfg, across: bool) -> float:
    """Ring bytes a rank sends per step in the data-parallel messages within its shard
    group, or across replicas."""
    return sum(msg.count * msg.size * algorithm_factor(msg.op, msg.group)
               for msg in step_traffic(cfg)
               if ("across replicas" in msg.what) == across and "activations" not in msg.what)


def test_hybrid_sharding_sends_the_closed_forms_within_the_shard_group_and_across():
    # ZeRO-1 at DP 8 with N = 2 (S = 4), untied: one bucket of Ψ = 4 layers, the final norm,
    # the embedding and the output layer, padded to a multiple of S (docs/design.md §27):
    # (S-1)/S Ψ_S (b + b) within, 2(N-1)/N Ψ_S/S b across, b = 4.
    flags = ["--use-distributed-optimizer", "--untie-embeddings-and-output-weights"]
    psi = -(-(4 * LAYER + H + 2 * V * H) // 4) * 4
    hybrid = config(8, *flags, "--num-distributed-optimizer-instances", "2")
    assert _wire_bytes(hybrid, across=False) == pytest.approx(3 / 4 * psi * 8)
    assert _wire_bytes(hybrid, across=True) == pytest.approx(2 * 1 / 2 * psi / 4 * 4)
    # One replica: all 2 (8-1)/8 Ψ b over the 8 ranks, nothing across.
    plain = config(8, *flags)
    assert _wire_bytes(plain, across=False) == pytest.approx(7 / 8 * -(-psi // 8) * 8 * 8)
    assert _wire_bytes(plain, across=True) == 0
    # HSDP (FSDP2, ZeRO-3) at DP 8, N = 4 (S = 2): each unit (the largest a layer) gathered
    # twice and reduce-scattered within the pair, its half-shard all-reduced over 4 replicas.
    msgs = by_what(config(8, "--use-torch-fsdp2", "--num-distributed-optimizer-instances",
                          "4"))
    assert {(m.op, m.group) for m in msgs.values()} == {
        ("all-gather", 2), ("reduce-scatter", 2), ("all-reduce", 4)}
    across = msgs["FSDP2 unit gradient shards across replicas"]
    assert (across.size, across.count) == (LAYER // 2 * 4, 5)


def test_the_tuner_adds_hybrid_sharding_past_one_node():
    def names(nodes):
        lean, _ = candidates(MODEL, 4, 16, lambda cfg: True, micro_batches=(1,),
                             max_degree=1, nodes=nodes)
        return {c.name: c.config.parallel.grid.num_distributed_optimizer_instances
                for c in lean}
    assert names(1) == {f"DP4{shard}, micro-batch 1": 1
                        for shard in ("", " ZeRO-1", " FSDP2 optim_grads_params",
                                      " FSDP2 optim_grads")}
    assert names(2) == {**names(1), **{f"DP4{shard} N 2, micro-batch 1": 2
                                       for shard in (" ZeRO-1", " HSDP optim_grads_params",
                                                     " HSDP optim_grads")}}
