"""Limits for an ``AdmissionController`` under test: answers a test sets (or counts), in place of the cluster's
(proxy/control/limits.py), so that admission is tested on its own."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FixedLimits:
    slots: int = 0  # decode slots
    room: bool = True  # room to prefill
    capped: bool = False  # the slots are a latency capacity
    freeing: int = 0  # decoding choices predicted to end within one prefill
    room_asked: int = 0  # times admission asked for room to prefill

    def decode_slots(self) -> int:
        return self.slots

    def latency_capped(self) -> bool:
        return self.capped

    def prefill_room(self) -> bool:
        self.room_asked += 1
        return self.room

    def slots_freeing(self) -> int:
        return self.freeing
