"""fullshard.optim (Note [matrix optimizers]): Muon bitwise torch.optim.Muon's on the same
gradients at every world size, training next to one process, its state under torch's keys
and checkpoints both ways at other world sizes, a user's own matrix optimizer, and refusals."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import distribute_tensor

import fullshard
from fullshard.gpt import Block
from fullshard.optim import MatrixOptimizer, Muon, muon_groups
from tests.models import tiny_gpt, token_batch
from tests.reference import global_batches, local_slice
from tests.test_errors import raises


class Experts(nn.Module):
    """Stacked expert weights, a 3-D parameter (a batch of 6 matrices)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 16, 24))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def matrices() -> nn.Module:
    """Wide, tall and square matrices, 37 rows among them (uneven over 2 and 4 ranks), and experts."""
    torch.manual_seed(0)
    return nn.ModuleList([nn.Linear(48, 64, bias=False), nn.Linear(64, 64, bias=False),
                          nn.Linear(64, 37, bias=False), Experts()])


def same_grads_job(mesh_shape: tuple[int, int] | None = None) -> dict:
    """Three steps of fullshard.optim.Muon on a sharded model and of torch.optim.Muon on the
    whole matrices (each expert a matrix of its own), given the same gradients: every
    parameter and momentum buffer compared bitwise."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")) if mesh_shape else None
    reference, model = matrices(), matrices()
    for module in model:
        fullshard.fully_shard(module, mesh=mesh)
    ours = Muon(model.parameters(), lr=0.02, weight_decay=0.1)
    whole = [p for p in reference.parameters() if p.dim() == 2]
    experts = [nn.Parameter(e.detach().clone()) for e in reference[3].w]
    theirs = torch.optim.Muon([*whole, *experts], lr=0.02, weight_decay=0.1)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=generator) for p in reference.parameters()]
        for p, grad in zip(model.parameters(), grads):
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements)
        step_both(ours, theirs, whole, experts, grads)
    mine = [p.full_tensor() for p in model.parameters()]
    buffers = [ours.state[p]["momentum_buffer"].full_tensor() for p in model.parameters()]
    want = [*(q.detach() for q in whole), torch.stack([e.detach() for e in experts])]
    want_buffers = [*(theirs.state[q]["momentum_buffer"] for q in whole),
                    torch.stack([theirs.state[e]["momentum_buffer"] for e in experts])]
    return {"params": [torch.equal(a, b) for a, b in zip(mine, want)],
            "buffers": [torch.equal(a, b) for a, b in zip(buffers, want_buffers)]}


def step_both(ours, theirs, whole: list, experts: list, grads: list[torch.Tensor]) -> None:
    """torch.optim.Muon's matrices (`whole`, and each expert of the last, stacked) given the
    gradients `grads` (the sharded model's, already given to `ours`), then both stepped."""
    for q, grad in zip(whole, grads):
        q.grad = grad.clone()
    for e, grad in zip(experts, grads[-1]):
        e.grad = grad.clone()
    ours.step()
    theirs.step()


def test_muon_is_torch_muon_bitwise_on_the_same_gradients(world1, world2, world4):
    for pool, shape in ((world1, None), (world2, None), (world4, None), (world4, (2, 2))):
        for got in pool.run(same_grads_job, mesh_shape=shape):
            assert all(got["params"]) and all(got["buffers"]), (pool.size, shape, got)


MUON_LR, ADAMW_LR = 0.02, 3e-3


def reference_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    matrices_, rest = muon_groups(model)
    return [torch.optim.Muon(matrices_, lr=MUON_LR), torch.optim.AdamW(rest, lr=ADAMW_LR, weight_decay=0.0)]


def one_process(batches: list, halves: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """torch.optim.Muon + AdamW on one process, the whole batch; the gradient summed over
    `halves` equal parts of it (2: each part's mean, then their mean, as two ranks sum)."""
    torch.manual_seed(0)
    model = tiny_gpt()
    optimizers = reference_optimizers(model)
    losses = []
    for batch in batches:
        parts = [local_slice(batch, i, halves) for i in range(halves)]
        grads = None
        for part in parts:
            loss = model(*part)
            got = torch.autograd.grad(loss, list(model.parameters()))
            grads = got if grads is None else [a + b for a, b in zip(grads, got)]
        for p, g in zip(model.parameters(), grads):
            p.grad = g / halves
        losses.append(loss.item())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def training_job(steps: int = 3) -> dict:
    """fullshard.optim.Muon (with its AdamW groups) on a GPT sharded per block, against one process."""
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = global_batches(token_batch, steps, 8)
    torch.manual_seed(0)
    model = fullshard.shard_model(tiny_gpt(), wrap={Block})
    matrices_, rest = muon_groups(model)
    optimizer = Muon([{"params": matrices_}, {"params": rest, "use_muon": False, "lr": ADAMW_LR,
                                              "weight_decay": 0.0}], lr=MUON_LR)
    for batch in batches:
        model(*local_slice(batch, rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()
    full, _ = fullshard.get_state_dict(model)
    whole = one_process(batches, 1)[1]
    halves = one_process(batches, world)[1]
    drift = lambda a, b: max((a[k] - b[k]).abs().max().item() for k in b)  # noqa: E731
    return {"vs whole": drift(full, whole), "halves vs whole": drift(halves, whole), "vs halves": drift(full, halves)}


def test_muon_trains_as_one_process_does(world2):
    """Sharded over 2 ranks, fullshard.optim.Muon (and its AdamW groups) is bitwise one process
    whose gradient is the mean of the two halves' (the sum the reduce-scatter makes); against
    one process on the whole batch it drifts no more than that one process does (Newton-Schulz
    in bf16 turns a regrouped gradient sum into steps that differ by bf16 roundings: measured
    1.0e-3 after 3 steps at lr 0.02, both ways alike)."""
    for got in world2.run(training_job):
        assert got["vs halves"] == 0.0, got
        assert got["vs whole"] <= got["halves vs whole"], got


class ToyShampoo(MatrixOptimizer):
    """A Shampoo-like preconditioner, written by a user: L += G G^T, R += G^T G, the update
    L^-1/4 G R^-1/4 (by eigendecomposition), kept whole on the owner during the step."""

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-4) -> None:
        super().__init__(params, dict(lr=lr, eps=eps))

    def matrix_state(self, shape, group):
        m, n = shape
        return {"left": ((m, m), torch.float32), "right": ((n, n), torch.float32)}

    def transform(self, matrix, state, group):
        state["left"].add_(matrix @ matrix.T)
        state["right"].add_(matrix.T @ matrix)
        return root(state["left"], group["eps"]) @ matrix @ root(state["right"], group["eps"])


def root(m: torch.Tensor, eps: float) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(m + eps * torch.eye(len(m)))
    return vectors @ torch.diag(values.clamp(min=eps) ** -0.25) @ vectors.T


def toy_job(path: str, save: bool) -> dict:
    """ToyShampoo on a sharded model against the same transform on the whole matrices in one
    process (bitwise: the owner computes on the same values); with `save`, a checkpoint of it,
    else that checkpoint loaded at this world size."""
    model = matrices()[:3]
    reference = matrices()[:3]
    for module in model:
        fullshard.fully_shard(module)
    optimizer = ToyShampoo(model.parameters())
    if not save:
        fullshard.load(path, model, optimizer)
        saved = torch.load(path + ".want", weights_only=True)
        states = [optimizer.state[p] for p in model.parameters()]
        loaded = all(torch.equal(p.full_tensor(), w) for p, w in zip(model.parameters(), saved["params"])) and \
            all(torch.equal(s[k].full_tensor() if hasattr(s[k], "full_tensor") else s[k], w[k])
                for s, w in zip(states, saved["states"]) for k in ("left", "right"))
        for p in model.parameters():  # and it steps on from there
            p.grad = torch.ones_like(p)
        optimizer.step()
        return {"loaded": loaded, "finite": all(p.full_tensor().isfinite().all().item() for p in model.parameters())}
    state = [{"left": torch.zeros(p.shape[0], p.shape[0]), "right": torch.zeros(p.shape[1], p.shape[1])}
             for p in reference.parameters()]
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=generator) for p in reference.parameters()]
        for p, grad in zip(model.parameters(), grads):
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements)
        optimizer.step()
        with torch.no_grad():
            for q, grad, s in zip(reference.parameters(), grads, state):
                q.add_(ToyShampoo.transform(optimizer, grad, s, {"eps": 1e-4}), alpha=-0.01)
    fullshard.save(path, model, optimizer)
    if dist.get_rank() == 0:
        torch.save({"params": [q.detach() for q in reference.parameters()], "states": state}, path + ".want")
    dist.barrier()
    same = [torch.equal(p.full_tensor(), q) for p, q in zip(model.parameters(), reference.parameters())]
    return {"same": same}


def test_a_users_matrix_optimizer_gets_whole_matrices_and_checkpoints_its_state(world2, world4, tmp_path):
    path = str(tmp_path / "toy")
    for got in world2.run(toy_job, path=path, save=True):
        assert all(got["same"]), got
    for got in world4.run(toy_job, path=path, save=False):  # its L and R at another world size
        assert got["loaded"] and got["finite"], got


def muon_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.full_tensor().detach() for p in model.parameters()] + \
        [optimizer.state[p]["momentum_buffer"].full_tensor() for p in model.parameters()]


def stepped(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        for p in model.parameters():
            p.grad = distribute_tensor(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)),
                                       p.device_mesh, p.placements)
        optimizer.step()


def checkpoint_job(path: str, make: str, load: bool) -> dict:
    """A model stepped by torch.optim.Muon or fullshard.optim.Muon (`make`), saved; or loaded
    (into `make`'s kind) from such a checkpoint: what it holds, whole."""
    model = matrices()[:3]
    for module in model:
        fullshard.fully_shard(module)
    optimizer = (torch.optim.Muon if make == "torch" else Muon)(model.parameters(), lr=0.02)
    if load:
        fullshard.load(path, model, optimizer)
    else:
        stepped(model, optimizer, 2)
        fullshard.save(path, model, optimizer)
    return {"state": muon_state(model, optimizer),
            "keys": sorted({key for p in model.parameters() for key in optimizer.state[p]})}


def test_muon_checkpoints_load_into_torch_muon_and_back_at_other_world_sizes(world1, world2, world4, tmp_path):
    theirs, ours = str(tmp_path / "torch"), str(tmp_path / "ours")
    saved = world2.run(checkpoint_job, path=theirs, make="torch", load=False)[0]  # as FSDP2 + torch's Muon save it
    for pool in (world1, world4):
        got = pool.run(checkpoint_job, path=theirs, make="ours", load=True)[0]
        assert got["keys"] == saved["keys"] == ["momentum_buffer"]
        assert all(torch.equal(a, b) for a, b in zip(got["state"], saved["state"])), pool.size
    mine = world4.run(checkpoint_job, path=ours, make="ours", load=False)[0]
    back = world2.run(checkpoint_job, path=ours, make="torch", load=True)[0]
    assert all(torch.equal(a, b) for a, b in zip(back["state"], mine["state"]))


def one_process_state_job() -> dict:
    """A one-process torch.optim.Muon's state dict, by parameter names, into fullshard.optim.Muon."""
    plain = matrices()[:3]
    optimizer = torch.optim.Muon(plain.parameters(), lr=0.02)
    for p in plain.parameters():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(0))
    optimizer.step()
    names = [n for n, _ in plain.named_parameters()]
    saved = optimizer.state_dict()
    named = {"state": {names[i]: s for i, s in saved["state"].items()},
             "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
    model = matrices()[:3]
    for module in model:
        fullshard.fully_shard(module)
    ours = Muon(model.parameters(), lr=0.02)
    fullshard.set_state_dict(model, ours, model_sd=plain.state_dict(), optim_sd=named)
    buffers = [(ours.state[p]["momentum_buffer"], optimizer.state[q]["momentum_buffer"])
               for p, q in zip(model.parameters(), plain.parameters())]
    return {"same": all(torch.equal(mine.full_tensor(), theirs) for mine, theirs in buffers)}


def test_a_one_process_torch_muon_state_loads(world2):
    assert all(got["same"] for got in world2.run(one_process_state_job))


def variant(name: str, batches: list) -> dict:
    """Two steps of a GPT sharded per block, stepped by Muon (and AdamW for the rest) as
    `name` says; its parameters, whole."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    if name == "meta":  # built on the meta device, materialized while sharded: the same values
        with torch.device("meta"):
            model = tiny_gpt()
    else:
        model = tiny_gpt()
    if name == "frozen":
        model.h[0].attn.c_attn.weight.requires_grad_(False)
    options = {"offload_policy": fullshard.CPUOffloadPolicy()} if name == "offload" else {}
    if name == "replace_fsdp2":  # FSDP2 code, unchanged, under fullshard
        with fullshard.replace_fsdp2():
            from torch.distributed.fsdp import fully_shard

            for block in model.h:
                fully_shard(block)
            fully_shard(model)
    else:
        fullshard.shard_model(model, wrap={Block}, **options)
    matrices_, rest = muon_groups(model)
    optimizer = Muon([{"params": matrices_}, {"params": rest, "use_muon": False, "lr": ADAMW_LR}], lr=MUON_LR)
    for batch in batches:
        mine = local_slice(batch, rank, world)
        if name == "no_sync":  # two micro-batches, the first without reducing
            with fullshard.no_sync(model):
                model(*local_slice(mine, 0, 2)).backward()
            model(*local_slice(mine, 1, 2)).backward()
            for p in model.parameters():
                p.grad.div_(2)
        else:
            model(*mine).backward()
        if name == "clip":
            fullshard.clip_grad_norm_(model, 0.5)
        optimizer.step()
        optimizer.zero_grad()
    return fullshard.get_state_dict(model)[0]


def everywhere_job() -> dict:
    batches = global_batches(token_batch, 2, 8)
    base = variant("plain", batches)
    out = {}
    for name in ("offload", "replace_fsdp2", "meta", "frozen", "no_sync", "clip"):
        got = variant(name, batches)
        out[name] = max((got[k] - base[k]).abs().max().item() for k in base)
    torch.manual_seed(0)
    frozen = tiny_gpt().h[0].attn.c_attn.weight
    out["frozen kept"] = torch.equal(variant("frozen", batches)["h.0.attn.c_attn.weight"], frozen)
    return out


def test_muon_with_offload_fsdp2_code_meta_init_frozen_weights_no_sync_and_clipping(world2):
    for got in world2.run(everywhere_job):
        # the same arithmetic: CPU offload steps the same shards; FSDP2's code builds the same
        # units; meta init draws the same values
        assert got["offload"] == got["replace_fsdp2"] == got["meta"] == 0.0, got
        assert got["frozen kept"] and got["frozen"] > 0, got  # the others moved, the frozen one did not
        # two micro-batches: the gradient summed in another order (a few fp32 roundings, which
        # bf16 Newton-Schulz may turn into a bf16 step of lr 0.02: at most ~1e-3, as above);
        # clipping at 0.5 scales the gradient, which Muon's normalization undoes but AdamW's
        # groups do not: they move
        assert 0 < got["no_sync"] <= 2e-3 and got["clip"] > 0, got


def tensor_parallel_job() -> dict:
    """2-D parallelism (dp 2 x tp 2, parallelize_module's colwise and rowwise weights): Muon's
    owner gathers each matrix over dp, then over tp; given the gradients the sharded model
    made, every parameter and momentum buffer bitwise torch.optim.Muon's on the whole matrices."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.models import TPLlama, tensor_parallel, tp_token_batch

    torch.manual_seed(0)
    reference = TPLlama()
    torch.manual_seed(0)
    model = TPLlama()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tensor_parallel(model, mesh["tp"])
    fullshard.shard_model(model, mesh=mesh["dp"])
    matrices_ = [p for p in model.parameters() if p.dim() == 2]
    whole = [p for p in reference.parameters() if p.dim() == 2]
    ours, theirs = Muon(matrices_, lr=0.02), torch.optim.Muon(whole, lr=0.02)
    x, y = tp_token_batch(torch.Generator().manual_seed(0), 8)
    for _ in range(2):
        model(x.chunk(2)[dist.get_rank() // 2], y.chunk(2)[dist.get_rank() // 2]).backward()
        for p, q in zip(matrices_, whole):
            q.grad = p.grad.full_tensor()
        ours.step()
        theirs.step()
        ours.zero_grad()
    return {"params": [torch.equal(p.full_tensor(), q) for p, q in zip(matrices_, whole)],
            "buffers": [torch.equal(ours.state[p]["momentum_buffer"].full_tensor(),
                                    theirs.state[q]["momentum_buffer"]) for p, q in zip(matrices_, whole)],
            "kinds": sorted({repr(p.placements[-1]) for p in matrices_})}


def test_muon_on_tensor_parallel_matrices_is_torch_muon_bitwise(world4):
    for got in world4.run(tensor_parallel_job):
        assert all(got["params"]) and all(got["buffers"]), got
        assert got["kinds"] == ["Shard(dim=0)", "Shard(dim=1)"], got  # colwise and rowwise weights both


def refusals_job() -> dict:
    model = matrices()[:3]
    for module in model:
        fullshard.fully_shard(module)
    plain = nn.Linear(4, 4)
    plain.weight.grad = torch.ones(4, 4)
    stray = Muon([plain.weight], lr=0.02)
    return {"vector": raises(lambda: Muon([nn.Parameter(torch.ones(3))])),
            "no model": raises(stray.step),
            "bad lr": raises(lambda: Muon(model.parameters(), lr=-1.0))}


def test_what_muon_cannot_step_is_refused_by_name(world2):
    got = world2.run(refusals_job)[0]
    assert "shape (3,), not a matrix" in got["vector"] and "muon_groups" in got["vector"], got
    assert "belongs to no fullshard model" in got["no model"], got
    assert "lr=-1.0" in got["bad lr"], got
