"""A model entry's ``federated:`` section: training as an axis of the sweep (:mod:`.federated` runs it).

::

    models:
      - spec: "cnn:3-8-2-1"
        federated:
          clients: 4            # K clients, every one trains every round
          partition: iid        # or dirichlet (with alpha)
          local_epochs: 1       # E epochs of minibatch SGD per round on the client's samples
          batch_size: 16        # the clients' minibatch b
          lr: 0.05              # the clients' learning rate η
          rounds: [0, 1, 5]     # the global models attacked (0 = the start); the run trains to the last
          public: 32            # images the attacker holds (never a client's): the attack's power per round

The sweep's ``seeds`` are the runs' seeds: each seed is one FedAvg run per (dataset, model, defense) — its
partition, data order and defense noise — and the batches attacked at its checkpoints.  The sweep's ``utility``
section does not apply to such a model: its utility is each run's own test accuracy and loss per round.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: the most rounds a run may train, clients it may simulate, and local epochs a client may run
MAX_ROUNDS = 100_000
MAX_CLIENTS = 10_000
MAX_LOCAL_EPOCHS = 1_000
PARTITIONS = ("iid", "dirichlet")


class FederatedEntry(BaseModel):
    """A FedAvg simulation per (dataset, model, defense, seed) whose checkpoints at ``rounds`` are attacked."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clients: int = Field(4, ge=1, le=MAX_CLIENTS)
    partition: str = "iid"
    alpha: float = Field(0.5, gt=0, le=1e6)
    local_epochs: int = Field(1, ge=1, le=MAX_LOCAL_EPOCHS)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(0.05, gt=0, le=1e6)
    #: samples each client trains on per round (a seeded draw of its data); None: all of them
    client_samples: int | None = Field(None, ge=1)
    rounds: list[int] = Field(min_length=1, max_length=1000)
    test_fraction: float = Field(0.2, gt=0, lt=1)
    #: images the attacker holds (disjoint from every client's data): the attack's power at each checkpoint
    public: int = Field(32, ge=0)

    @field_validator("partition")
    @classmethod
    def _partition(cls, value: str) -> str:
        if value not in PARTITIONS:
            raise ValueError(f"expected partition {' or '.join(PARTITIONS)}, got {value!r}")
        return value

    @field_validator("rounds")
    @classmethod
    def _rounds(cls, values: list[int]) -> list[int]:
        bad = [v for v in values if v < 0 or v > MAX_ROUNDS]
        if bad:
            raise ValueError(f"expected rounds in 0..{MAX_ROUNDS} (0 = the start), got {bad[0]}")
        return sorted(set(values))

    @model_validator(mode="after")
    def _bounded(self) -> FederatedEntry:
        work = max(self.rounds) * self.clients * self.local_epochs
        if work > 10**8:
            raise ValueError(f"expected rounds × clients × local_epochs ≤ 10^8 client epochs, got {work:,}; "
                             "lower rounds, clients or local_epochs")
        return self

    def run_options(self) -> dict[str, Any]:
        """What decides a run (a trial's ``training["federated"]``): every field but the attacked rounds."""
        return self.model_dump(exclude={"rounds"})


__all__ = ["FederatedEntry", "PARTITIONS", "MAX_ROUNDS", "MAX_CLIENTS", "MAX_LOCAL_EPOCHS"]
