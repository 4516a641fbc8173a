"""Time on the device's own clock: a GPU runs its work after the host has queued it, so a timer that does not
synchronise measures the queueing. Ground level: imports nothing of the project."""

from __future__ import annotations

import re
import time

import torch


def synchronize(device) -> None:
    """Wait for the device (a timer around work queued on a GPU must, or it measures the queueing)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device) -> str:
    """What a measured cost is kept under: the GPU's model ("NVIDIA-H200"), or "cpu".

    >>> device_name("cpu")
    'cpu'
    """
    device = torch.device(device)
    if device.type == "cuda":
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", torch.cuda.get_device_name(device)).strip("-")
    return device.type


def mark(device):
    """A :class:`Clock` mark on ``device``'s timeline, for code that has no clock at hand (a drafter noting when its
    catch-up ended, ``Drafter.caught_up``)."""
    return Clock(device).mark()


class Clock:
    """Marks on the device's own timeline: CUDA events on a GPU (read after the step's one synchronisation, so timing
    adds none), the host's clock on a CPU (which has run what it was given before returning).

    >>> clock = Clock("cpu"); a = clock.mark(); b = clock.mark(); Clock.seconds(a, b) >= 0
    True
    """

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @staticmethod
    def seconds(begin, end) -> float:
        """Seconds between two marks (CUDA events: once ``end`` has completed)."""
        if isinstance(begin, float):
            return end - begin
        end.synchronize()
        return begin.elapsed_time(end) / 1000.0
