"""
Crash backoff (DESIGN §6.4): a failure delays the next placement of its
deployment (of its variant, for a deployment with variants: see
L{llmgw.control.core.context.DeploymentState}), doubling from C{base} up to
C{cap}; a replica that stays ready for C{reset_after} forgives the past.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Backoff:
    base: float = 10.0
    cap: float = 300.0
    reset_after: float = 600.0
    failures: int = 0
    until: float = 0.0

    def delay(self) -> float:
        """
        The delay the current failure count earns.
        """
        if self.failures <= 0:
            return 0.0
        # Cap the exponent too: 2**1000 is a float overflow.
        return float(min(self.cap, self.base * 2 ** min(self.failures - 1, 30)))

    def failed(self, now: float) -> float:
        """
        Count a failure at C{now}; returns the delay until placement may
        resume.
        """
        self.failures += 1
        delay = self.delay()
        self.until = now + delay
        return delay

    def blocked(self, now: float) -> bool:
        return now < self.until

    def ready_for(self, seconds: float) -> bool:
        """
        Whether a replica ready for C{seconds} resets the count.
        """
        return self.failures > 0 and seconds >= self.reset_after

    def reset(self) -> None:
        self.failures = 0
        self.until = 0.0
