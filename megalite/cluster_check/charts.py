"""The report's PNG charts (weak scaling, collective bus bandwidth), drawn when matplotlib, the
`plot` extra, is installed; without it the report says why there are none."""

import os

from megalite.atomic_write import atomic_path


def import_pyplot():
    """matplotlib.pyplot on the Agg backend, or None when the `plot` extra is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def scaling_chart(ax, points):
    n, eff = zip(*points)
    ax.plot(n, [100 * e for e in eff], "o-", label="measured")
    for level in (90, 80):
        ax.axhline(level, linestyle="--", color="grey")
        ax.text(n[-1], level, f" {level}%", va="center")
    ax.set(xscale="log", xlabel="ranks", ylabel="efficiency (%)",
           ylim=(0, max(110, 110 * max(eff))), title="Weak scaling: tokens/s per rank vs 1 rank")
    ax.set_xticks(n, [str(v) for v in n])
    ax.minorticks_off()


def bandwidth_chart(ax, measured: dict):
    for op in dict.fromkeys(op for op, _ in measured):
        sizes = sorted(size for o, size in measured if o == op)
        ax.plot([s / 2 ** 10 for s in sizes], [measured[op, s] for s in sizes], "o-", label=op)
    ax.set(xscale="log", yscale="log", xlabel="message (KiB)", ylabel="bus bandwidth (GB/s)",
           title="Collectives over all ranks")
    ax.legend()


def write_charts(output_dir: str, charts: dict) -> list[str]:
    """The PNGs of `charts` ("scaling.png": points, "busbw.png": measured) and the report's
    lines linking them, or a line saying why there are none."""
    if not charts:
        return []
    plt = import_pyplot()
    if plt is None:
        return ["(Charts skipped: matplotlib is not installed; `pip install -e .[plot]` "
                "installs it.)", ""]
    draw = {"scaling.png": (scaling_chart, "weak scaling"),
            "busbw.png": (bandwidth_chart, "collective bus bandwidth")}
    lines = []
    for name, data in charts.items():
        fn, title = draw[name]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        fn(ax, data)
        fig.tight_layout()
        with atomic_path(os.path.join(output_dir, name), ".tmp.png") as tmp:
            fig.savefig(tmp)
        plt.close(fig)
        lines += [f"![{title}]({name})", ""]
    return lines

