"""The demo's plot (``pglockkit demo --plot``), drawn from made-up steps: no server."""

from __future__ import annotations

import numpy as np  # with matplotlib, in the dev extra (`pglockkit[plot]` for users)

from pglockkit.demo.model import DESIGNS, Step
from pglockkit.demo.report import figure

AGENTS = (1, 2, 4, 8, 16)


def _steps() -> list[Step]:
    rate = {"global": lambda n: 50.0, "queue": lambda n: 100.0 * n, "sharded": lambda n: 90.0 * n}
    return [
        Step(design, n, 1.0, int(rate[design](n)), rate[design](n), 0.0, int(rate[design](n)))
        for design in DESIGNS
        for n in AGENTS
    ]


def test_the_plots_ideal_is_a_straight_line_on_labelled_log_axes():
    """The agents double from step to step, and the x axis was logarithmic while the y axis was
    linear: the ideal (1-agent rate x N) curved upwards, and a design that scaled looked as if it
    fell behind. Both axes are now logarithmic, labelled so, and the ideal is a straight line:
    its points, mapped to the axes, are evenly spaced in both directions."""
    import matplotlib.pyplot as plt

    fig = figure(_steps())
    try:
        (ax,) = fig.axes
        assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
        assert "log" in ax.get_xlabel() and "log" in ax.get_ylabel()
        assert [t.get_text() for t in ax.get_xticklabels()] == [str(n) for n in AGENTS]
        (ideal,) = [line for line in ax.get_lines() if line.get_label().startswith("ideal")]
        shown = ax.transData.transform(np.column_stack(ideal.get_data()))  # in display pixels
        steps = np.diff(shown, axis=0)
        assert np.allclose(steps, steps[0], rtol=1e-6), steps  # a straight line, evenly spaced
        assert steps[0][0] > 0 and steps[0][1] > 0
    finally:
        plt.close(fig)
