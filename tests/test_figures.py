"""`featcache plot`'s figure: its title wrapped to the figure, never cut at either side, and its class legend right
of the panels, never over them (the PNG's tight bounding box takes both in)."""

from __future__ import annotations

import numpy as np

from featcache.results.features import Features
from featcache.results.figures import figure_png


def test_plot_title_wraps_and_the_legend_sits_beside_the_panels(monkeypatch, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    saved, real = [], plt.Figure.savefig

    def spy(fig, *a, **k):
        out = real(fig, *a, **k)
        boxes = [fig.legends[0].get_window_extent(), *(ax.get_window_extent() for ax in fig.axes if ax.get_visible())]
        saved.append((fig, boxes))
        return out

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    rng = np.random.default_rng(0)
    P, C = 60, 2
    feats = Features(
        z=rng.normal(size=(P, 4)),
        client=np.repeat(np.arange(C), P // C),
        label=rng.integers(0, 3, P),
        algo="fedavg",
        seed=0,
        clients=C,
        classes=["a long class name", "b", "c"],
        cache={},
    )
    heading = (
        "fedavg: learned features (embed), PCA, seed 0, test split, 60 of 60 points — imagefolder cache " + "a" * 16
    )
    data = figure_png(rng.normal(size=(P, 2)), feats, np.arange(P), ["PC 1", "PC 2"], heading, ["d1", "d2"])
    fig, (legend, *panels) = saved[0]
    width = int(fig.get_figwidth() * 13)
    title = fig._suptitle.get_text().splitlines()
    assert len(title) > 1 and all(len(line) <= width for line in title) and " ".join(title) == heading
    assert len(panels) == C and all(legend.x0 >= box.x1 for box in panels)  # right of every panel
    (tmp_path / "p.png").write_bytes(data)
    from PIL import Image

    with Image.open(tmp_path / "p.png") as im:  # the tight box holds the legend: wider than the figure's own size
        assert im.size[0] > fig.get_figwidth() * 110
