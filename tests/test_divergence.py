"""Ranks that diverge (Note [named hangs]): another unit, another model, another order, a model
skipped, rows of another size. Each ends in a named error on every rank, at once where a rank
receives another collective's rows, never in mixed rows or a process killed inside gloo."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

from torch.utils._python_dispatch import TorchDispatchMode

import fullshard
from fullshard import routes
from fullshard.gpt import GPT, Block, GPTConfig
from fullshard.routes import FIRST_BYTES
from fullshard.tags import HEADER_BYTES, HEADER_TAG
from tests.models import SEQ, VOCAB, token_batch
from tests.reference import global_batches, local_slice
from tests.test_errors import raises
from tests.world import World


class SkippingGPT(GPT):
    """A GPT in which one rank skips a block, as a data-dependent branch might."""

    skip: int | None = None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for i, block in enumerate(self.h):
            if i != self.skip:
                x = block(x)
        logits = torch.nn.functional.linear(self.ln_f(x), self.wte.weight)
        return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def gpt(width: int, layers: int = 2, cls: type = GPT) -> GPT:
    return cls(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=layers, n_head=2, n_embd=width))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return local_slice(global_batches(token_batch, 1, 8)[0], dist.get_rank(), dist.get_world_size())


def timed(fn) -> dict:
    start = time.monotonic()
    return {"message": raises(fn), "seconds": time.monotonic() - start}


def divergence_job(debug: bool, width: int) -> dict:
    torch.manual_seed(0)
    model = gpt(width, layers=3, cls=SkippingGPT)
    fullshard.shard_model(model, wrap={Block})
    model.set_debug_checks(debug)
    model(*batch()).backward()  # step 1: every rank alike
    model.set_timeout(3)  # from step 2 only: on busy cores, step 1 may wait seconds for a peer
    model.skip = 1 if dist.get_rank() == 1 else None  # step 2: rank 1 skips block h.1
    return timed(lambda: model(*batch()).backward())


def test_a_rank_skipping_a_unit_fails_every_rank_at_once_naming_the_units():
    # width 30: a block's shard is a small message, which gloo sends as one all_to_all; width
    # 192: 0.9 MB, sent point-to-point after its header (Note [named hangs])
    results = {}
    for case, debug, width in (("debug", True, 30), ("all_to_all", False, 30), ("p2p", False, 192)):
        with World(2, forked=True) as world:  # a new world: a divergence leaves the process group unusable
            results[case] = world.run(divergence_job, debug=debug, width=width)
    for got in results["debug"]:  # debug checks: both ranks learn what each was about to do
        assert "rank 0: all-gather of unit 'h.1' of model" in got["message"], got
        assert "rank 1: all-gather of unit 'h.2' of model" in got["message"], got
    for case in ("all_to_all", "p2p"):  # each rank sees at once that its peer sent another unit's rows
        first, second = (got["message"] for got in results[case])
        assert "the all-gather of unit 'h.1' of model" in first and "at step 2 received the all-gather of unit 'h.2'" \
            in first and "from group rank 1" in first, (case, first)
        assert "the all-gather of unit 'h.2' of model" in second and "at step 2 received the all-gather of unit " \
            "'h.1'" in second and "from group rank 0" in second, (case, second)
    for got in [*results["debug"], *results["all_to_all"], *results["p2p"]]:
        assert got["seconds"] < 3, got  # well before the 3 s timeout


def two_models_job(widths: tuple[int, int], order: str, small_message: int) -> dict:
    """Two sharded GPTs, a and b (a teacher and a student, say). Step 1 runs a, then b, on every
    rank; then each rank runs them as `order` says: 'swapped' (odd ranks b then a), 'skip' (the
    last rank b alone), or 'first' (no step 1: the swap happens at the very first forward)."""
    routes.SMALL_MESSAGE = small_message  # in this forked rank only: the route every unit takes
    torch.manual_seed(0)
    a, b = gpt(widths[0]), gpt(widths[1])
    for model in (a, b):
        fullshard.shard_model(model, wrap={Block})
    rank, world = dist.get_rank(), dist.get_world_size()
    if order != "first":
        for model in (a, b):
            model(*batch()).backward()
    for model in (a, b):
        model.set_timeout(3)
    if order == "skip":
        sequence = [b] if rank == world - 1 else [a, b]
    else:
        sequence = [b, a] if rank % 2 else [a, b]

    def step() -> None:
        for model in sequence:
            model(*batch()).backward()

    return timed(step)


MODEL = re.compile(r"model \d+ \(GPT\)")
ROUTES = {"all_to_all": routes.SMALL_MESSAGE, "p2p": 0}


@pytest.mark.parametrize("world_size", [2, 4])
def test_two_models_in_another_order_fail_every_rank_at_once_naming_both(world_size):
    """Same-architecture models swapped, models of other widths swapped (rows of another size:
    gloo would abort the process), a model skipped on one rank, a swap at the first forward;
    on both of gloo's routes."""
    cases = [("swapped", (32, 32), route) for route in ROUTES] + [("swapped", (32, 48), route) for route in ROUTES]
    cases += [("skip", (32, 32), "all_to_all"), ("skip", (32, 48), "p2p"), ("first", (32, 48), "all_to_all")]
    for order, widths, route in cases:
        with World(world_size, forked=True) as world:
            results = world.run(two_models_job, widths=widths, order=order, small_message=ROUTES[route])
        first_use = {}  # each rank's models in the order it ran them at the step that diverged
        for rank, got in enumerate(results):
            message = got["message"]
            assert got["seconds"] < 3, (order, widths, route, rank, got)  # at once, not at the 3 s timeout
            if order == "first":  # the first forward's check: before any rows move
                assert "ranks run their first forward differently" in message, (rank, message)
                assert len(set(MODEL.findall(message))) == 2, message  # both models, each rank's named
                continue
            # each rank names its own collective, of one model, and what a peer sent: the other's
            mine, theirs = message.split(" received ", 1)
            assert MODEL.findall(mine)[0] != MODEL.findall(theirs)[0], (order, widths, route, rank, message)
            first_use[rank] = MODEL.findall(mine)[0]
        if order == "swapped":  # the ids are the same on every rank: rank 1 ran first what rank 0 ran second
            assert first_use[0] != first_use[1] and first_use[0] == first_use[world_size - 2], first_use
        slowest = max(got["seconds"] for got in results)  # docs/reliability.md
        print(f"world {world_size}, {order} {widths} on {route}: every rank's error within {slowest:.3f} s")


class Messages(TorchDispatchMode):
    """Every c10d operation this rank issues: (name, bytes it sends, tag of a point-to-point send)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int, int | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func.__name__.split(".")[0]
            sent = args[1] if name in ("_allgather_base_", "alltoall_base_") else args[0]
            tensors = sent if isinstance(sent, (list, tuple)) else [sent]
            self.ops.append((name, sum(t.nbytes for t in tensors), args[3] if name == "send" else None))
        return func(*args, **(kwargs or {}))


def messages_job(strategy: str, width: int) -> list[tuple[str, int, int | None]]:
    """The c10d operations of one training step's backward (after the first) of a GPT of `width`."""
    torch.manual_seed(0)
    model = gpt(width)
    fullshard.shard_model(model, wrap={Block}, strategy=strategy)
    model(*batch()).backward()
    loss = model(*batch())
    with Messages() as log:
        loss.backward()
    return log.ops


def test_headers_travel_inside_the_rows(world2, world4):
    """Note [named hangs]: no header is a message of its own, or a collective of its own that the
    rows wait for. Width 192: blocks of 0.9 MB per rank, point-to-point (two messages a peer,
    the first the header with the rows' first 64 KiB); no_shard: the all-reduce across replicas,
    over 2 replicas (every row to the other) and 4 (a reduce-scatter, then an all-gather)."""
    for world, strategy, width in ((world2, "full_shard", 192), (world2, "no_shard", 32), (world4, "no_shard", 32)):
        for ops in world.run(messages_job, strategy=strategy, width=width):
            names = {name for name, _, _ in ops}
            assert names <= {"send", "recv_", "alltoall_base_"}, (strategy, names)  # no all-gather of headers
            heads = [nbytes for name, nbytes, tag in ops if name == "send" and tag == HEADER_TAG]
            assert all(nbytes > HEADER_BYTES for nbytes in heads), (strategy, heads)  # rows with every header
            if width == 192:  # each first message carries 64 KiB of rows
                assert heads and all(nbytes == HEADER_BYTES + FIRST_BYTES for nbytes in heads), heads


def no_shard_job() -> dict:
    """no_shard: every exchange is the all-reduce across replicas."""
    torch.manual_seed(0)
    a, b = gpt(32), gpt(48)
    for model in (a, b):
        fullshard.shard_model(model, wrap={Block}, strategy="no_shard")
        model(*batch()).backward()
        model.set_timeout(3)
    sequence = [b, a] if dist.get_rank() % 2 else [a, b]
    return timed(lambda: [model(*batch()).backward() for model in sequence])


@pytest.mark.parametrize("world_size", [2, 4])
def test_models_swapped_under_no_shard_fail_naming_both(world_size):
    # 4 replicas: the all-reduce is two rounds (Note [replica sums]); each is named
    with World(world_size, forked=True) as world:
        results = world.run(no_shard_job)
    for got in results:
        assert "all-reduce across replicas of unit" in got["message"] and " received the all-reduce across replicas " \
            "of unit" in got["message"], got
        assert got["seconds"] < 3, got


def other_calls_job() -> dict:
    """Rank 0 shards a second model while rank 1 runs the first forward of the first: two of
    fullshard's all-gathers of integers of other lengths meet (gloo would abort on them)."""
    torch.manual_seed(0)
    model = gpt(32)
    fullshard.shard_model(model, wrap={Block})
    if dist.get_rank() == 0:
        return timed(lambda: fullshard.shard_model(gpt(48), wrap={Block}))
    return timed(lambda: model(*batch()))


def test_ranks_at_other_checks_fail_naming_both():
    with World(2, forked=True) as world:
        first, second = world.run(other_calls_job)
    assert "the comparison of the parameters ranks shard met the check of the first forward of group rank 1" \
        in first["message"], first
    assert "the check of the first forward met the comparison of the parameters ranks shard of group rank 0" \
        in second["message"], second
    assert first["seconds"] < 3 and second["seconds"] < 3


def unit_alone_job() -> dict:
    """Rank 0's first forward is the model's, rank 1's one of its blocks alone."""
    torch.manual_seed(0)
    model = gpt(32)
    fullshard.shard_model(model, wrap={Block})
    model.set_timeout(3)
    if dist.get_rank() == 0:
        return timed(lambda: model(*batch()))
    return timed(lambda: model.h[1](torch.randn(2, SEQ, 32)))


def test_a_block_run_alone_on_one_rank_is_named_as_that_block():
    with World(2, forked=True) as world:
        first, second = world.run(unit_alone_job)
    # rank 0 names what rank 1 ran by its place in the model rank 0 runs, not as that model
    assert re.search(r"rank 0: model \d+ \(GPT\), training \(with gradients\); rank 1: unit 'h.1' of model \d+ "
                     r"\(GPT\) alone", first["message"]), first
    assert "ranks run their first forward differently" in second["message"], second
    assert first["seconds"] < 3 and second["seconds"] < 3
