"""The Pareto plot of ``gradzip bench``: link-byte ratio against the final metric, labels placed
where they overlap nothing."""

from __future__ import annotations

import math

import numpy as np

from .config import BenchConfig


def pareto_front(points) -> list[int]:
    """Indices of the non-dominated ``(ratio, accuracy)`` points (both higher is better), by
    ratio ascending (accuracy then descends). A point is dominated when another is at least as
    good in both and better in one; equal points are all kept."""
    pts = [(float(x), float(y)) for x, y in points]
    keep = []
    for i, (x, y) in enumerate(pts):
        if not any(a >= x and b >= y and (a > x or b > y) for a, b in pts):
            keep.append(i)
    return sorted(keep, key=lambda i: (pts[i][0], -pts[i][1]))


def _ratio_label(x: float, _pos=None) -> str:
    if x >= 1:
        return f"{int(round(x)):,}×"
    return f"{x:.2g}×"


def _overlap(a, b) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def _outside(box, frame) -> float:
    """The area of ``box`` outside ``frame``."""
    inside = _overlap(box, frame)
    return box.width * box.height - inside


def _candidates():
    """Label offsets (points) from the marker: near ones first, all around."""
    out = []
    for r in (6, 10, 16, 24, 34, 46, 60, 76):
        for k in range(16):
            a = 2 * math.pi * k / 16 + (math.pi / 16 if r % 4 else 0)
            out.append((r * math.cos(a), r * math.sin(a)))
    return out


def place_labels(ax, xs, ys, labels, fontsize=8, obstacles=(), renderer=None, pad_px=2.0) -> list:
    """Annotate point i with ``labels[i]`` where its box overlaps no other label, marker, error
    bar or ``obstacles`` (display-space ``Bbox``es) and stays inside the axes, searching offsets
    around the point nearest first (the least overlap if no place is free). The axes' limits and
    position must be final. A label whose nearest edge ends away from its point gets a thin
    leader line to that edge.
    Returns the annotations, in the order of ``labels``."""
    from matplotlib.transforms import Bbox

    fig = ax.figure
    renderer = renderer or fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    disp = ax.transData.transform(np.column_stack([xs, ys]))
    r_px = 4 * fig.dpi / 72
    blocked = [Bbox.from_bounds(x - r_px, y - r_px, 2 * r_px, 2 * r_px) for x, y in disp] + list(obstacles)
    placed = []
    anns = [None] * len(labels)
    # Crowded points first: they have the fewest free places.
    crowd = [sum(1.0 / (1.0 + math.dist(p, q)) for q in disp) for p in disp]
    cands = _candidates()
    for i in sorted(range(len(labels)), key=lambda i: -crowd[i]):
        ann = ax.annotate(
            labels[i],
            (xs[i], ys[i]),
            xytext=(0, 0),
            textcoords="offset points",
            fontsize=fontsize,
            annotation_clip=False,
        )
        best, best_cost = None, math.inf
        for dx, dy in cands:
            ha = "left" if dx > 1e-6 else "right" if dx < -1e-6 else "center"
            va = "bottom" if dy > 1e-6 else "top" if dy < -1e-6 else "center"
            if abs(dx) < 2:
                ha = "center"
            ann.set_ha(ha)
            ann.set_va(va)
            ann.xyann = (dx, dy)
            box = ann.get_window_extent(renderer).padded(pad_px)
            cost = sum(_overlap(box, b) for b in placed) + sum(_overlap(box, b) for b in blocked)
            cost += 10 * _outside(box, frame)
            if cost < best_cost:
                best, best_cost = (dx, dy, ha, va, box), cost
                if cost == 0:
                    break
        dx, dy, ha, va, box = best
        ann.set_ha(ha)
        ann.set_va(va)
        ann.xyann = (dx, dy)
        placed.append(box)
        # a leader line from the marker to the nearest point of a label that ends away from it
        px, py = disp[i]
        cx, cy = min(max(px, box.x0), box.x1) - px, min(max(py, box.y0), box.y1) - py
        if math.hypot(cx, cy) > 3 * r_px:
            ax.annotate(
                "",
                (xs[i], ys[i]),
                xytext=(cx * 72 / fig.dpi, cy * 72 / fig.dpi),
                textcoords="offset points",
                arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.5", "shrinkA": 6, "shrinkB": 4},
                zorder=1,
            )
        anns[i] = ann
    return anns


def pareto_figure(rows: list[dict], cfg: BenchConfig):
    """Link-byte ratio (log x) against the final metric (test accuracy, or the language model's
    validation loss, whose axis is drawn inverted so that better is up): mean over seeds with
    min..max bars, the Pareto frontier as a step line, the baseline (Identity) as a line with its
    band. Returns ``(figure, axes, label annotations)``; the caller closes the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    from matplotlib.transforms import Bbox

    key = cfg.metric
    scale, sign = (100.0, 1.0) if key == "accuracy" else (1.0, -1.0)  # plotted as sign * value
    xs = np.array([max(r["ratio"], 1e-3) for r in rows])
    ys = np.array([sign * scale * r[key] for r in rows])
    lo = np.array([sign * scale * r.get(f"{key}_min" if sign > 0 else f"{key}_max", r[key]) for r in rows])
    hi = np.array([sign * scale * r.get(f"{key}_max" if sign > 0 else f"{key}_min", r[key]) for r in rows])
    base = next((r for r in rows if r["method"] == "Identity"), None)

    fig, ax = plt.subplots(figsize=(8, 5))
    if base is not None:
        b0, b1 = sorted(sign * scale * base.get(f"{key}_{e}", base[key]) for e in ("min", "max"))
        ax.axhspan(b0, b1, color="tab:gray", alpha=0.15, lw=0, label="Identity, min..max over seeds")
        ax.axhline(sign * scale * base[key], color="tab:gray", lw=1, ls="--", label="Identity (baseline), mean")
    n = max(r.get("n_seeds", 1) for r in rows)
    front = pareto_front(list(zip(xs, ys)))
    on_front = set(front)
    ax.step(xs[front], ys[front], where="pre", color="tab:red", lw=1.2, alpha=0.8, label="Pareto frontier", zorder=2)
    for i in range(len(rows)):
        ax.errorbar(
            xs[i],
            ys[i],
            yerr=[[ys[i] - lo[i]], [hi[i] - ys[i]]],
            fmt="o",
            ms=5,
            capsize=3,
            lw=1,
            color="tab:red" if i in on_front else "tab:blue",
            zorder=3,
            label=f"mean, bars min..max over {n} seed{'s' if n > 1 else ''}" if i == 0 else None,
        )
    # Limits first (labels are placed in display space).
    x0, x1 = xs.min(), xs.max()
    span = max(math.log10(x1 / x0), 1.0)
    ax.set_xscale("log")
    ax.set_xlim(x0 / 10 ** (0.12 * span), x1 * 10 ** (0.25 * span))
    y_lo = min(lo.min(), ys.min())
    y_hi = max(hi.max(), ys.max())
    if base is not None:
        y_lo, y_hi = min(y_lo, b0), max(y_hi, b1)
    pad = max(y_hi - y_lo, 0.5)
    top = y_hi + 0.2 * pad
    ax.set_ylim(y_lo - 0.25 * pad, min(top, 100.0 + 0.05 * pad) if key == "accuracy" else top)
    ax.xaxis.set_major_locator(LogLocator(base=10))
    ax.xaxis.set_major_formatter(FuncFormatter(_ratio_label))
    ax.xaxis.set_minor_locator(LogLocator(base=10, subs=(2.0, 3.0, 5.0)))
    decades = math.log10(ax.get_xlim()[1] / ax.get_xlim()[0])
    ax.xaxis.set_minor_formatter(FuncFormatter(_ratio_label) if decades < 2.5 else NullFormatter())
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("link-byte ratio against plain DDP's ring allreduce (log)")
    if key == "accuracy":
        ax.set_ylabel("final test accuracy (%)")
    else:
        ax.set_ylabel("final validation loss (nats/byte; up is better)")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{-v:.3f}"))
    ax.set_title(
        f"gradzip bench: {cfg.dataset}, {cfg.workers} ranks, {cfg.length()}, "
        f"{cfg.optimizer} (lr {cfg.lr:g}, momentum {cfg.momentum:g}, {cfg.lr_schedule}"
        f"{cfg.hook_extras()})",
        fontsize=10,
    )
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", alpha=0.1)
    legend = ax.legend(loc="lower left", fontsize=7, framealpha=0.9)
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    obstacles = [legend.get_window_extent(renderer)]
    for i in range(len(rows)):  # error bars
        (px, py0), (_, py1) = ax.transData.transform([(xs[i], lo[i]), (xs[i], hi[i])])
        obstacles.append(Bbox.from_extents(px - 3, py0, px + 3, py1))
    anns = place_labels(ax, xs, ys, [r["method"] for r in rows], obstacles=obstacles, renderer=renderer)
    return fig, ax, anns


def plot_pareto(rows: list[dict], cfg: BenchConfig, path: str) -> None:
    """:func:`pareto_figure` saved to ``path`` (PNG)."""
    fig, _, _ = pareto_figure(rows, cfg)
    import matplotlib.pyplot as plt  # after pareto_figure chose the Agg backend

    fig.savefig(path, dpi=120)
    plt.close(fig)
