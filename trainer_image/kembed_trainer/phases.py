"""The trainer's seconds by phase (kembed_contract.job_seconds names them), reported with its records.

Phases nest (an eval's checkpoint save inside the training loop); a second counts for the innermost phase open at
the time, so the phases never overlap and add up to the time measured.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping

from kembed_contract import job_seconds

__all__ = ["PhaseClock"]


class PhaseClock:
    def __init__(self, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._totals = dict.fromkeys(job_seconds.TRAINER_PHASES, 0.0)
        self._open: list[str] = []
        self._mark = clock()

    @classmethod
    def since_launch(cls, entered_at: float, environ: Mapping[str, str] | None = None) -> PhaseClock:
        """A clock for a trainer whose first line ran at unix time `entered_at`: the time from the launcher's start
        (job_seconds.ENV_LAUNCHED_AT, when a launcher set it) to then is process start, the time since imports."""
        phases = cls()
        launched = (os.environ if environ is None else environ).get(job_seconds.ENV_LAUNCHED_AT, "")
        with contextlib.suppress(ValueError):
            started = float(launched)
            if math.isfinite(started):
                phases.add("process_start", max(0.0, entered_at - started))
        phases.add("imports", max(0.0, time.time() - entered_at))
        return phases

    def add(self, phase: str, seconds: float) -> None:
        """Count `seconds` measured elsewhere for `phase`."""
        self._totals[phase] += seconds

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self._totals:
            raise KeyError(f"{name!r} is not one of the trainer's phases {job_seconds.TRAINER_PHASES}")
        self._switch_to(name)
        try:
            yield
        finally:
            self._switch_to(None)

    def _switch_to(self, name: str | None) -> None:
        now = self._clock()
        if self._open:
            self._totals[self._open[-1]] += now - self._mark
        if name is None:
            self._open.pop()
        else:
            self._open.append(name)
        self._mark = now

    def seconds(self) -> dict[str, float]:
        """Seconds by phase so far (the open phase up to now), rounded to the millisecond."""
        totals = dict(self._totals)
        if self._open:
            totals[self._open[-1]] += self._clock() - self._mark
        return {phase: round(s, 3) for phase, s in totals.items()}
