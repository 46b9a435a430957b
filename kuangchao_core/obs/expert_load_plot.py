"""The plot of a MoE model's expert load over training (issue 40 item 5), attached to the MLflow run.

Top panel: each MoE layer's load imbalance (busiest expert's tokens over the mean) against the step. Below, one
panel per MoE layer (at most :data:`MAX_LAYER_PANELS`, spread evenly over the layers when there are more; the
title says which): a heat map of each expert's share of the layer's tokens (rows: experts, columns: the steps
kept), so an expert that starves or takes over shows as a dark or bright band. Drawn with matplotlib's Agg canvas
(no display, no global pyplot state) into an RGB image.
"""

from __future__ import annotations

import numpy as np

#: the most per-layer heat maps one figure shows
MAX_LAYER_PANELS = 8


def shown_layers(layers: list[int], most: int = MAX_LAYER_PANELS) -> list[int]:
    """``layers`` when at most ``most``, else ``most`` of them evenly spread, the first and last included."""
    if len(layers) <= most:
        return list(layers)
    picks = np.linspace(0, len(layers) - 1, most).round().astype(int)
    return [layers[i] for i in sorted(set(picks.tolist()))]


def load_shares(loads: list[dict[int, list[int]]], layer: int) -> np.ndarray:
    """Experts × steps: each expert's share of ``layer``'s tokens at each kept step (0 where nothing was routed)."""
    counts = np.asarray([step[layer] for step in loads], dtype=np.float64).T
    total = counts.sum(axis=0, keepdims=True)
    return np.divide(counts, total, out=np.zeros_like(counts), where=total > 0)


def expert_load_image(steps: list[int], loads: list[dict[int, list[int]]]) -> np.ndarray:
    """The figure (module docstring) as a uint8 height × width × 3 array; ``loads[k]``: decoder layer -> tokens
    per expert at ``steps[k]``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    layers = sorted(loads[0])
    shown = shown_layers(layers)
    fig = Figure(figsize=(10, 2.6 + 1.8 * len(shown)), dpi=80)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1 + len(shown), 1, squeeze=False)[:, 0]
    for layer in layers:
        shares = load_shares(loads, layer)
        axes[0].plot(steps, shares.max(axis=0) * shares.shape[0], label=f"layer {layer}", lw=1)
    axes[0].set_ylabel("max / mean tokens")
    axes[0].set_title("MoE load imbalance per layer")
    axes[0].grid(alpha=0.3)
    if len(layers) <= 12:
        axes[0].legend(fontsize="small", ncol=min(len(layers), 6))
    for ax, layer in zip(axes[1:], shown, strict=True):
        shares = load_shares(loads, layer)
        image = ax.imshow(
            shares,
            aspect="auto",
            interpolation="nearest",
            extent=(steps[0] - 0.5, steps[-1] + 0.5, shares.shape[0] - 0.5, -0.5),
            vmin=0.0,
        )
        ax.set_ylabel("expert")
        ax.set_title(f"layer {layer}: share of the layer's tokens per expert")
        fig.colorbar(image, ax=ax, fraction=0.03)
    axes[-1].set_xlabel("step")
    if len(shown) < len(layers):
        fig.suptitle(f"heat maps of {len(shown)} of the {len(layers)} MoE layers: {shown}")
    fig.tight_layout()
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
