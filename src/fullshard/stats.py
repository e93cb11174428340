"""Stats: exact communication and memory accounting of the units under one root."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Stats:
    """Counts since the last reset, for this rank.

    Bytes are bytes this rank sends: what a bandwidth-optimal algorithm must send
    ((N-1)/N of a gather's output, of a reduce-scatter's input, 2(N-1)/N of an
    all-reduce). The `*_wire_bytes` properties are what the algorithm in use sends; the
    algorithms used here (point-to-point or all_to_all on gloo, NCCL's rings) are
    bandwidth-optimal, so they are the same counts (not counted: the 24-element tag at the
    end of each row of a small gloo message, Note [named hangs]). `wait_s` is host time
    blocked on communication (on GPUs waits are stream waits and cost no host time).
    Peaks are of full (unsharded) parameters and gradients alive at once, in bytes.
    """

    steps: int = 0  # backward passes finished
    skipped_steps: int = 0  # steps whose gradients were dropped for being non-finite (set_nonfinite_grads("skip"))
    gathers: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0  # across replicas (hybrid sharding, no_shard)
    gather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    all_reduce_bytes: int = 0
    wait_s: float = 0.0
    full_param_bytes: int = 0  # alive now
    full_grad_bytes: int = 0  # alive now, as far as the units have seen them
    peak_full_param_bytes: int = 0
    peak_full_grad_bytes: int = 0
    per_unit: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))

    @property
    def intra_group_bytes(self) -> int:
        """Logical bytes inside the shard group (gathers and reduce-scatters): within a node
        under hybrid sharding."""
        return self.gather_bytes + self.reduce_scatter_bytes

    @property
    def cross_group_bytes(self) -> int:
        """Logical bytes across replicas (hybrid sharding's all-reduce): the cross-node traffic."""
        return self.all_reduce_bytes

    @property
    def gather_wire_bytes(self) -> int:
        return self.gather_bytes

    @property
    def reduce_scatter_wire_bytes(self) -> int:
        return self.reduce_scatter_bytes

    @property
    def all_reduce_wire_bytes(self) -> int:
        return self.all_reduce_bytes

    @property
    def sent_bytes(self) -> int:
        """Everything this rank put on the wire."""
        return self.gather_wire_bytes + self.reduce_scatter_wire_bytes + self.all_reduce_wire_bytes

    def reset(self) -> Stats:
        """Zero the counters (peaks restart from what is alive now) and return self."""
        alive = (self.full_param_bytes, self.full_grad_bytes)
        self.__init__()
        self.full_param_bytes, self.full_grad_bytes = alive
        self.peak_full_param_bytes, self.peak_full_grad_bytes = alive
        return self

    def __enter__(self) -> Stats:
        return self.reset()

    def __exit__(self, *exc: object) -> None:
        return None

    def count(self, unit: str, kind: str, nbytes: int) -> None:
        """One collective of `kind` ("gather", "reduce_scatter", "all_reduce") by `unit`, sending `nbytes`."""
        setattr(self, kind + "s", getattr(self, kind + "s") + 1)
        setattr(self, kind + "_bytes", getattr(self, kind + "_bytes") + nbytes)
        self.per_unit[unit][kind + "s"] += 1

    def waited(self, seconds: float) -> None:
        """The host was blocked on communication for `seconds`."""
        self.wait_s += seconds

    def finished_step(self) -> None:
        """A backward pass finished."""
        self.steps += 1

    def skipped_step(self) -> None:
        """The step's gradients were dropped for being non-finite."""
        self.skipped_steps += 1

    def full_params(self, delta: int) -> None:
        self.full_param_bytes += delta
        self.peak_full_param_bytes = max(self.peak_full_param_bytes, self.full_param_bytes)

    def full_grads(self, delta: int) -> None:
        self.full_grad_bytes += delta
        self.peak_full_grad_bytes = max(self.peak_full_grad_bytes, self.full_grad_bytes)

    def per_step(self) -> dict[str, float]:
        """Counters divided by the finished backward passes (peaks as they are)."""
        steps = max(self.steps, 1)
        out: dict[str, float] = {}
        for name in ("gathers", "reduce_scatters", "all_reduces", "gather_bytes", "gather_wire_bytes",
                     "reduce_scatter_bytes", "reduce_scatter_wire_bytes", "all_reduce_bytes",
                     "all_reduce_wire_bytes", "wait_s"):
            out[name] = getattr(self, name) / steps
        out["sent_bytes"] = self.sent_bytes / steps
        out["peak_full_param_bytes"] = self.peak_full_param_bytes
        out["peak_full_grad_bytes"] = self.peak_full_grad_bytes
        return out


def process_memory(field: str) -> int:
    """One of this process's memory figures in /proc/self/status (VmRSS, VmHWM, ...), in bytes (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
