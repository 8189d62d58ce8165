"""The plan tools/estimate_cost.py prints: each input resolved from the flags (or the
cluster check's report, or the price table) with where it came from, then time and cost,
then spot's preemptions and checkpoint interval."""

import math
from dataclasses import dataclass

from megalite.config import DTYPE_NAMES, Config
from megalite.cost.measured import read_cluster_report
from megalite.cost.plan import SpotRun, flops_per_token, optimal_interval, run_seconds
from megalite.cost.prices import DEFAULT_TABLE, find_offer, gpu_kind, load_offers
from megalite.errors import ConfigError
from megalite.memory_estimate import num_model_parameters
from megalite.memory_estimate.checkpoint import MEASURED_WRITE_GBPS, planned_save_seconds
from megalite.monitoring.peak_flops import PEAK_TFLOPS


@dataclass(frozen=True)
class Inputs:
    """Every number the plan uses, each with the words that say where it came from."""
    gpu: str
    peak_tflops: float
    mfu: float
    prices: dict[str, tuple[float, str]]
    """{"on demand" / "spot": (USD per GPU-hour, the flag or offer that gave it)}."""
    offer: str | None
    """The price table's offer used, in words."""
    save_s: float
    save: str


def resolve(config: Config, args) -> Inputs:
    """`args`: tools/estimate_cost.py's flags. Raises ConfigError naming the flag."""
    measured = read_cluster_report(args.cluster_report) if args.cluster_report else None
    try:
        gpu = gpu_kind(args.gpu)
    except ConfigError:
        if config.monitoring.peak_tflops is None:
            raise
        gpu = args.gpu  # a device the peak table lacks: --peak-tflops gives its peak
    peak = config.monitoring.peak_tflops or _table_peak(gpu, config)
    mfu = args.mfu if args.mfu is not None else measured.mfu if measured else None
    if mfu is None:
        raise ConfigError("give --mfu (a fraction of the peak, e.g. 0.4), or --cluster-report "
                          "with a measured MFU" + (f": {args.cluster_report} has none (its "
                                                   "--tune table is missing or says n/a)"
                                                   if measured else ""))
    if not 0.0 < mfu <= 1.0:
        raise ConfigError(f"--mfu must be in (0, 1], a fraction of the peak, got {mfu:g}"
                          + (" (read from --cluster-report)" if args.mfu is None else ""))
    return Inputs(gpu, peak, mfu, *_prices(gpu, args), *_save_seconds(config, args, measured))


def _table_peak(gpu: str, config: Config) -> float:
    # fp32 matmuls run on TF32 tensor cores on CUDA (initialize.allow_tf32).
    dtype = DTYPE_NAMES[config.precision.params_dtype].replace("fp32", "tf32")
    if dtype not in PEAK_TFLOPS[gpu]:
        raise ConfigError(f"--gpu {gpu} has no {dtype} tensor-core peak in "
                          "monitoring/peak_flops.py; give --peak-tflops")
    return PEAK_TFLOPS[gpu][dtype]


def _prices(gpu: str, args) -> tuple[dict[str, tuple[float, str]], str | None]:
    """({"on demand" / "spot": (USD per GPU-hour, the flag or offer that gave it)}, the
    table's offer in words if one was used)."""
    path = args.prices or DEFAULT_TABLE
    offer = find_offer(load_offers(path), gpu, args.offer, path)
    prices = {}
    for kind, flag, given in (("on demand", "--on-demand-price", args.on_demand_price),
                              ("spot", "--spot-price", args.spot_price)):
        listed = getattr(offer, kind.replace(" ", "_")) if offer else None
        if given is not None or listed is not None:
            prices[kind] = (given, flag) if given is not None else (listed, offer.offer)
    if not prices:
        raise ConfigError(f"no price for {gpu} in {path}: give --on-demand-price and/or "
                          "--spot-price (USD per GPU-hour), or --prices with one")
    used = offer and any(tag == offer.offer for _, tag in prices.values())
    return prices, (f"{offer.offer}: {' '.join(offer.what.split())}; {offer.source}, "
                    f"{offer.date}" if used else None)


def _save_seconds(config: Config, args, measured) -> tuple[float, str]:
    if args.save_seconds is not None:
        return args.save_seconds, "--save-seconds (measured)"
    gbps, source = args.save_gbps, "--save-gbps"
    if gbps is None and measured and measured.save_gbps:
        gbps, source = measured.save_gbps, "the cluster check's measured save rate"
    if gbps is None:
        gbps, source = MEASURED_WRITE_GBPS, "a measured floor, docs/benchmarks.md"
    seconds, nbytes = planned_save_seconds(config, gbps)
    return seconds, (f"planned: the slowest rank's {nbytes / 1e9:.3g} GB at {gbps:g} GB/s "
                     f"per rank ({source})")


def plan_lines(config: Config, args, tokens: float, tokens_from: str) -> list[str]:
    """The printed plan; `tokens`: the run's training tokens, `tokens_from` the flags."""
    inputs = resolve(config, args)
    per_token = flops_per_token(config.model)
    seconds = run_seconds(tokens, per_token, args.num_gpus, inputs.peak_tflops, inputs.mfu)
    gpu_hours = args.num_gpus * seconds / 3600
    lines = [f"megalite cost plan: {num_model_parameters(config) / 1e9:.3f}B parameters, "
             f"{per_token:.4g} training FLOPs per token (the MFU's count)",
             f"  tokens: {tokens:.4g} ({tokens_from})",
             f"  {args.num_gpus} x {inputs.gpu} at {inputs.peak_tflops:g} TFLOP/s dense peak, "
             f"MFU {inputs.mfu:g}",
             f"time: {seconds / 3600:.2f} h wall-clock, {gpu_hours:.1f} GPU-hours"]
    for kind, (price, source) in inputs.prices.items():
        lines.append(f"cost {kind}: {gpu_hours:.1f} GPU-hours x ${price:g} ({source}) = "
                     f"${gpu_hours * price:,.2f}{' before preemptions' if kind == 'spot' else ''}")
    if inputs.offer:
        lines.append(f"  prices (USD per GPU-hour) of {inputs.offer}")
    return lines + spot_lines(config, args, inputs, seconds)


def spot_lines(config: Config, args, inputs: Inputs, work_s: float) -> list[str]:
    lines = [f"save: {inputs.save_s:.3g} s ({inputs.save})"]
    notice = config.checkpoint.preemption_notice_seconds
    if notice is not None and inputs.save_s > notice:
        lines.append(f"WARNING: the save takes longer than the {notice:g} s "
                     "--preemption-notice-seconds: a save on the notice is cut off")
    if not args.preemption_rate:
        return lines + ["spot preemptions not planned (--preemption-rate: preemptions per "
                        "node-hour)"]
    nodes = math.ceil(args.num_gpus / args.gpus_per_node)
    mtbf_s = 3600.0 / (args.preemption_rate * nodes)
    best = optimal_interval(inputs.save_s, mtbf_s)
    interval = args.checkpoint_interval_minutes * 60 if args.checkpoint_interval_minutes \
        else best
    run = SpotRun(work_s, interval, inputs.save_s, mtbf_s, args.restart_minutes * 60)
    hours, spot = args.num_gpus * run.total_s / 3600, inputs.prices.get("spot", (None,))[0]
    lines += [f"spot: {args.preemption_rate:g} preemptions per node-hour x {nodes} node"
              f"{'s' if nodes > 1 else ''} ({args.gpus_per_node} GPUs each): one every "
              f"{mtbf_s / 3600:.3g} h",
              f"  Young/Daly interval sqrt(2 x {inputs.save_s:.3g} s x {mtbf_s:.4g} s) = "
              f"{best / 60:.1f} min of training between saves"
              + ("" if interval == best else
                 f"; planned with --checkpoint-interval-minutes "
                 f"{args.checkpoint_interval_minutes:g}"),
              f"  expected: {run.preemptions:.1f} preemptions, {run.lost_s / 3600:.2f} h of "
              f"work lost, {run.segments * inputs.save_s / 3600:.2f} h saving, "
              f"{run.preemptions * run.restart_s / 3600:.2f} h restarting "
              f"(--restart-minutes {args.restart_minutes:g})",
              f"  wall-clock {run.total_s / 3600:.2f} h, {hours:.1f} GPU-hours"
              + (f" x ${spot:g} = ${hours * spot:,.2f} on spot" if spot else "")]
    return lines
