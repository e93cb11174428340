"""Stats: exact communication and memory accounting of the units under one root, read from the
counters each unit keeps of its own collectives (Unit.counts) and the root's memory meter, so
that counting costs a training step no call."""

from __future__ import annotations

COUNTERS = ("gathers", "reduce_scatters", "all_reduces", "exchanges", "gather_bytes", "reduce_scatter_bytes",
            "all_reduce_bytes", "exchange_bytes", "wait_s")
PER_UNIT = ("gathers", "reduce_scatters", "all_reduces")


def new_counts() -> dict[str, float]:
    """A unit's counters (Unit.counts): collectives and the bytes this rank sent in them, host seconds waited."""
    return dict.fromkeys(COUNTERS, 0)


def new_meter() -> list[int]:
    """A root's memory meter: [full parameter bytes alive, their peak, full gradient bytes, their peak]."""
    return [0, 0, 0, 0]


class Stats:
    """Counts since the last reset, for this rank.

    Bytes are bytes this rank sends: what a bandwidth-optimal algorithm must send
    ((N-1)/N of a gather's output, of a reduce-scatter's input, 2(N-1)/N of an
    all-reduce). The `*_wire_bytes` properties are what the algorithm in use sends; the
    algorithms used here (point-to-point or all_to_all on gloo, NCCL's rings) are
    bandwidth-optimal, so they are the same counts (not counted: the 16-byte header of each
    gloo message, Note [named hangs]). `wait_s` is host time blocked on communication (on
    GPUs waits are stream waits and cost no host time). Peaks are of full (unsharded)
    parameters and gradients alive at once, in bytes.
    """

    def __init__(self, root) -> None:
        self.root = root  # a Root: its units' counters, its memory meter and step counts
        self.base: dict[str, float] = {}
        self.unit_base: dict[str, dict[str, float]] = {}

    def total(self, name: str) -> float:
        return sum(unit.counts[name] for unit in self.root.units) - self.base.get(name, 0)

    gathers = property(lambda self: self.total("gathers"))
    reduce_scatters = property(lambda self: self.total("reduce_scatters"))
    all_reduces = property(lambda self: self.total("all_reduces"))  # across replicas (hybrid sharding, no_shard, DiLoCo's syncs)
    gather_bytes = property(lambda self: self.total("gather_bytes"))
    reduce_scatter_bytes = property(lambda self: self.total("reduce_scatter_bytes"))
    all_reduce_bytes = property(lambda self: self.total("all_reduce_bytes"))
    exchanges = property(lambda self: self.total("exchanges"))  # a matrix optimizer's (Muon's) rows to their owners and back
    exchange_bytes = property(lambda self: self.total("exchange_bytes"))
    wait_s = property(lambda self: self.total("wait_s"))
    gather_wire_bytes = gather_bytes
    reduce_scatter_wire_bytes = reduce_scatter_bytes
    all_reduce_wire_bytes = all_reduce_bytes

    @property
    def steps(self) -> int:
        """Backward passes finished."""
        return self.root.steps_counted - self.base.get("steps", 0)

    @property
    def skipped_steps(self) -> int:
        """Steps whose gradients were dropped for being non-finite (set_nonfinite_grads("skip"))."""
        return self.root.skipped - self.base.get("skipped_steps", 0)

    full_param_bytes = property(lambda self: self.root.shared.meter[0])  # alive now
    peak_full_param_bytes = property(lambda self: self.root.shared.meter[1])
    full_grad_bytes = property(lambda self: self.root.shared.meter[2])  # alive now, as far as the units have seen them
    peak_full_grad_bytes = property(lambda self: self.root.shared.meter[3])

    @property
    def per_unit(self) -> dict[str, dict[str, int]]:
        """Collectives by unit, of the kinds it ran."""
        out = {}
        for unit in self.root.units:
            base = self.unit_base.get(unit.fqn, {})
            counts = {kind: unit.counts[kind] - base.get(kind, 0) for kind in PER_UNIT}
            if any(counts.values()):
                out[unit.fqn] = {kind: n for kind, n in counts.items() if n}
        return out

    @property
    def intra_group_bytes(self) -> int:
        """Logical bytes inside the shard group (gathers and reduce-scatters): within a node
        under hybrid sharding."""
        return self.gather_bytes + self.reduce_scatter_bytes

    @property
    def cross_group_bytes(self) -> int:
        """Logical bytes across replicas (hybrid sharding's all-reduce, DiLoCo's syncs): the cross-node traffic."""
        return self.all_reduce_bytes

    @property
    def sent_bytes(self) -> int:
        """Everything this rank put on the wire."""
        return self.gather_wire_bytes + self.reduce_scatter_wire_bytes + self.all_reduce_wire_bytes + self.exchange_bytes

    def reset(self) -> Stats:
        """Zero the counters (peaks restart from what is alive now) and return self."""
        self.base = {}
        self.base = {name: self.total(name) for name in COUNTERS}
        self.base["steps"], self.base["skipped_steps"] = self.root.steps_counted, self.root.skipped
        self.unit_base = {unit.fqn: dict(unit.counts) for unit in self.root.units}
        meter = self.root.shared.meter
        meter[1], meter[3] = meter[0], meter[2]
        return self

    def __enter__(self) -> Stats:
        return self.reset()

    def __exit__(self, *exc: object) -> None:
        return None

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


def return_freed_memory() -> None:
    """Make glibc give freed memory back to the OS: its mmap threshold (which grows to 32 MB as
    tensors are freed) set to 64 KiB, so that this process's resident memory follows its live
    tensors. `fullshard train`'s ranks and the planner's probe run so (Note [runtime probe]):
    the peak the planner predicts is the peak train reports. A no-op where glibc is absent."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def process_memory(field: str) -> int:
    """One of this process's memory figures in /proc/self/status (VmRSS, VmHWM, ...), in bytes (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
