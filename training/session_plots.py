"""Charts of a session: the loss curve, and per-step memory and transfers."""
from __future__ import annotations

from PIL import Image

from .plots import line_chart
from .session import TrainingSession


def loss_chart(session: TrainingSession) -> Image.Image:
    losses = list(session.losses)
    window = max(1, len(losses) // 20)
    smooth = [sum(losses[max(0, i - window + 1): i + 1]) / len(losses[max(0, i - window + 1): i + 1])
              for i in range(len(losses))]
    series = {"loss": losses, f"mean of {window}": smooth}
    if session.validation_losses:  # at the steps done when scored; a training loss at the steps done before it
        series["validation"] = [(float(step), loss) for step, loss in session.validation_losses]
    title = "Training and validation loss" if session.validation_losses else "Training loss"
    return line_chart(series, title=title, xlabel="step", ylabel=f"flow-matching loss ({session.config.loss})")


def memory_chart(session: TrainingSession) -> Image.Image:
    stats = session.stats
    gib = 2 ** 30
    series = {"peak allocated (GiB)": [s["peak_allocated_bytes"] / gib for s in stats],
              "streamed in (GiB)": [s["h2d_bytes"] / gib for s in stats],
              "step time (s)": [s["step_time_s"] for s in stats],
              "transfer wait (s)": [s["transfer_wait_s"] for s in stats]}
    return line_chart(series, title="Memory and transfers per step", xlabel="step", ylabel="GiB / seconds")
