"""The one place that names a message between ranks: what a send posts and a receive waits for.

A message is (direction, sending stage, microbatch): F carries stage s's output activation to
stage s + 1, B carries stage s's input gradient to stage s - 1. Lowering matches sends with
receives by it, the step simulation delivers it, and the runtime derives each transfer's peer and
tag from it, so the three cannot disagree.
"""

from __future__ import annotations

from typing import NamedTuple

from .ir import Action, Kind


class Message(NamedTuple):
    """One tensor crossing from one stage to its neighbour."""

    direction: Kind
    """Kind.F (activation, to stage + 1) or Kind.B (input gradient, to stage - 1)."""
    sender: int
    """The stage that sends it."""
    microbatch: int
    """Its microbatch."""

    @property
    def receiver(self) -> int:
        """The stage that receives it."""
        return self.sender + 1 if self.direction is Kind.F else self.sender - 1

    def tag(self, num_microbatches: int) -> int:
        """A tag unique to the message within a step (point-to-point ops match on it)."""
        return (self.sender * num_microbatches + self.microbatch) * 2 + (0 if self.direction is Kind.F else 1)

    def __str__(self) -> str:
        return f"{self.sender}SEND_{self.direction.value}{self.microbatch}"


def message_of(action: Action) -> Message:
    """The message a SEND_F/SEND_B posts or a RECV_F/RECV_B waits for."""
    kind, s, m = action.kind, action.stage, action.microbatch
    if kind is Kind.SEND_F:
        return Message(Kind.F, s, m)
    if kind is Kind.SEND_B:
        return Message(Kind.B, s, m)
    if kind is Kind.RECV_F:
        return Message(Kind.F, s - 1, m)
    if kind is Kind.RECV_B:
        return Message(Kind.B, s + 1, m)
    raise ValueError(f"{action} is not a send or a receive")
