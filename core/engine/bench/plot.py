"""`--plot FILE.png`: token usage, #queue-req and throughput over the run, one panel each;
people read those curves faster than a table."""

from __future__ import annotations

from engine.bench.result import BenchResult, Sample

WINDOW_S = 0.5


def throughput_curve(timeline: list[Sample], window: float = WINDOW_S):
    """(times, output tok/s) over consecutive windows of about ``window`` seconds."""
    times, rates, prev = [], [], None
    for s in timeline:
        if prev is None:
            prev = s
            continue
        if s.t - prev.t >= window or s is timeline[-1]:
            if s.t > prev.t:
                times.append(s.t)
                rates.append((s.output_tokens - prev.output_tokens) / (s.t - prev.t))
            prev = s
    return times, rates


def write_plot(result: BenchResult, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        from engine.errors import EngineError

        raise EngineError("--plot needs matplotlib, which is not installed: pip install "
                          "matplotlib (or engine-cli[bench]).") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result.timeline
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    panels = [("token usage", [s.token_usage for s in tl]),
              ("#queue-req", [s.num_queue_reqs for s in tl])]
    for ax, (label, values) in zip(axes, panels):
        pts = [(s.t, v) for s, v in zip(tl, values) if v is not None]
        if pts:
            ax.plot(*zip(*pts), drawstyle="steps-post")
        else:
            ax.text(0.5, 0.5, "not reported by the server", ha="center",
                    transform=ax.transAxes)
        ax.set_ylabel(label)
    axes[0].set_ylim(0, 1.05)
    times, rates = throughput_curve(tl)
    axes[2].plot(times, rates)
    axes[2].set_ylabel("output tok/s")
    axes[2].set_xlabel("seconds")
    fig.suptitle(f"engine bench {result.mode}: {result.dataset_name}, {result.completed} "
                 f"requests, {result.output_throughput:.1f} output tok/s")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
