"""Results and figures: `report` renders result files as a markdown table and PNG figures, `plot` draws the features
a trained head learned."""

from .features import plot
from .render import report

__all__ = ["plot", "report"]
