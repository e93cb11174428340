"""What fullshard.optim.Muon takes, checked where it enters (Note [matrix identity], Muon's and
AdamW's rules): ranks that list parameters in other orders get torch.optim.Muon's bits; ranks
that step other matrices get a named error on every rank within the timeout, never a process
killed inside gloo; every hyperparameter and state value is checked by its kind's rules in the
constructor, add_param_group, load_state_dict, set_state_dict and fullshard.load; added groups
are stepped and survive a state-dict round trip."""

from __future__ import annotations

import contextlib
import math
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import distribute_tensor

import fullshard
from fullshard.optim import Muon
from tests.shared_file import rewrite
from tests.test_errors import raises
from tests.test_optim import matrices, step_both
from tests.world import World


def sharded() -> nn.Module:
    model = matrices()
    for module in model:
        fullshard.fully_shard(module)
    return model


def gradients(step: int, shapes: list[torch.Size]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def give(model: nn.Module, grads: list[torch.Tensor]) -> None:
    for p, grad in zip(model.parameters(), grads):
        p.grad = distribute_tensor(grad, p.device_mesh, p.placements)


def order_job() -> dict:
    """Each rank lists the matrices in another order (rank 0 as built, rank 1 reversed, others
    rotated); two steps against torch.optim.Muon on the whole matrices, bitwise."""
    rank = dist.get_rank()
    reference, model = matrices(), sharded()
    params = list(model.parameters())
    order = [params, params[::-1]][rank] if rank < 2 else params[rank:] + params[:rank]
    ours = Muon(order, lr=0.02)
    whole = [p for p in reference.parameters() if p.dim() == 2]
    experts = [nn.Parameter(e.detach().clone()) for e in reference[3].w]
    theirs = torch.optim.Muon([*whole, *experts], lr=0.02)
    shapes = [p.shape for p in reference.parameters()]
    for step in range(2):
        grads = gradients(step, shapes)
        give(model, grads)
        step_both(ours, theirs, whole, experts, grads)
    want = [*(q.detach() for q in whole), torch.stack([e.detach() for e in experts])]
    return {"same": [torch.equal(p.full_tensor(), w) for p, w in zip(model.parameters(), want)],
            "set": raises(lambda: Muon(set(params))),
            "set group": raises(lambda: Muon([{"params": set(params)}]))}


def test_any_order_of_parameters_gives_torch_muons_bits_and_a_set_is_refused(world2, world4):
    for pool in (world2, world4):
        for got in pool.run(order_job):
            assert all(got["same"]), (pool.size, got)
            assert "a set of parameters" in got["set"] and "a set of parameters" in got["set group"], got


def differ_job(case: str) -> dict:
    """Ranks that would exchange other matrices: a gradient None on the last rank, or a matrix in
    its AdamW group, or another lr there. Every rank's error, and how long it took."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = sharded()
    for module in model:
        module.set_timeout(2)
    params = list(model.parameters())
    last = rank == world - 1
    if case == "adamw group" and last:
        opt = Muon([{"params": params[1:]}, {"params": params[:1], "use_muon": False}], lr=0.02)
    else:
        opt = Muon(params, lr=0.03 if case == "lr" and last else 0.02)
    give(model, gradients(0, [p.shape for p in params]))
    if case == "grad None" and last:
        params[1].grad = None
    before = [p.to_local().clone() for p in params]
    start = time.monotonic()
    message = raises(opt.step)
    seconds = time.monotonic() - start
    unchanged = all(torch.equal(p.to_local(), b) for p, b in zip(params, before)) and \
        not any(opt.state[p] for p in params)  # no parameter moved, no momentum kept: nothing lost
    return {"message": message, "seconds": seconds, "unchanged": unchanged}


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_that_step_other_matrices_fail_by_name_within_the_timeout(size):
    cases = ("grad None", "adamw group", "lr")
    # a world per case (the exchange that never matched leaves the group unusable), all at once:
    # their timeouts run out together
    with contextlib.ExitStack() as stack:
        worlds = [stack.enter_context(World(size, forked=True)) for _ in cases]
        for world, case in zip(worlds, cases):
            world.submit(differ_job, case=case)
        answers = [world.answers(differ_job) for world in worlds]
    for case, results in zip(cases, answers):
        for rank, got in enumerate(results):
            assert "Muon's exchange of the rows of the matrices to their owners did not finish" in got["message"] \
                and "Every rank must step the same matrices" in got["message"], (case, rank, got)
            assert got["seconds"] < 2 + 5, (case, rank, got)  # the 2 s timeout, and a loaded machine's delay
            assert got["unchanged"], (case, rank, got)
            print(f"world {size}, {case}: rank {rank}'s error after {got['seconds']:.2f} s")  # docs/reliability.md


def hostile_job() -> dict:
    """Every raw error of the hostile inputs, each refused by name with nothing changed."""
    model = sharded()
    params = list(model.parameters())
    plain = nn.Sequential(nn.Linear(48, 64, bias=False), nn.Linear(64, 64, bias=False))  # the shapes of two
    out = {}
    for name, kwargs in {"ns_steps 2.5": dict(ns_steps=2.5), "ns_steps 10**9": dict(ns_steps=10**9),
                         "coefficients 1e300": dict(ns_coefficients=(1e300, 1.0, 1.0)), "lr nan": dict(lr=math.nan),
                         "lr inf": dict(lr=math.inf), "momentum 2": dict(momentum=2.0), "eps 0": dict(eps=0.0),
                         "lr tensor of 2": dict(lr=torch.tensor([0.1, 0.2]))}.items():
        out[name] = raises(lambda: Muon(params, **kwargs))
    for name, group in {"betas 2": dict(betas=(2.0, 0.999)), "betas -1": dict(betas=(-1.0, 0.999)),
                        "eps -1": dict(eps=-1.0), "lr -1": dict(lr=-1.0)}.items():
        out["adamw " + name] = raises(lambda: Muon([{"params": params[:1]},
                                                    {"params": params[1:2], "use_muon": False, **group}]))
    out["in two groups"] = raises(lambda: Muon([{"params": params[:2]},
                                                {"params": params[1:3], "use_muon": False}]))
    opt = Muon(params[:2], lr=0.02)
    out["vector added"] = raises(lambda: opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]}))
    out["twice added"] = raises(lambda: opt.add_param_group({"params": params[1:2]}))
    out["groups after refusals"] = len(opt.param_groups)
    give(model, gradients(0, [p.shape for p in params]))
    opt.step()
    before = opt.state_dict()
    # state dicts of another shape or kind, straight into load_state_dict and through set_state_dict
    wrong = {"state": {0: {"momentum_buffer": torch.zeros(3, 3)}}, "param_groups": before["param_groups"]}
    out["load (3,3) buffer"] = raises(lambda: opt.load_state_dict(wrong))
    adamw = torch.optim.AdamW(plain.parameters())
    for p in plain.parameters():
        p.grad = torch.ones_like(p)
    adamw.step()
    out["load AdamW state"] = raises(lambda: opt.load_state_dict(adamw.state_dict()))
    nine = {**before, "param_groups": [{**before["param_groups"][0], "ns_steps": 10**9}]}
    out["load ns_steps 10**9"] = raises(lambda: opt.load_state_dict(nine))
    names = ["0.weight", "1.weight"]
    named = {"state": {names[0]: {"momentum_buffer": torch.zeros(3, 3)}},
             "param_groups": [{**before["param_groups"][0], "params": names}]}
    out["set_state_dict (3,3) buffer"] = raises(lambda: fullshard.set_state_dict(
        model, opt, model_sd=fullshard.get_state_dict(model)[0], optim_sd=named))
    after = opt.state_dict()
    out["unchanged"] = all(torch.equal(a["momentum_buffer"].full_tensor(), b["momentum_buffer"].full_tensor())
                           for a, b in zip(before["state"].values(), after["state"].values())) and \
        before["param_groups"] == after["param_groups"]
    return out


def test_hostile_optimizer_inputs_are_refused_by_name_where_they_enter(world2):
    got = world2.run(hostile_job)[0]
    assert "ns_steps=2.5 is not an int from 0 to 99" in got["ns_steps 2.5"], got
    assert "ns_steps=1000000000 is not an int" in got["ns_steps 10**9"], got
    assert "ns_coefficients=(1e+300, 1.0, 1.0) are not three finite numbers" in got["coefficients 1e300"], got
    assert "lr=nan is not a finite number" in got["lr nan"] and "lr=inf is not a finite" in got["lr inf"], got
    assert "momentum=2.0 must be at most 1" in got["momentum 2"] and "eps=0.0 must be above 0" in got["eps 0"], got
    assert "lr, a tensor, must be one floating-point element" in got["lr tensor of 2"], got
    # Muon's AdamW groups by AdamW's rules
    assert "betas[0]=2.0 must be below 1" in got["adamw betas 2"], got
    assert "betas[0]=-1.0 must be at least 0" in got["adamw betas -1"], got
    assert "eps=-1.0 must be above 0" in got["adamw eps -1"] and "lr=-1.0 must be at least 0" in got["adamw lr -1"]
    assert "parameter 'weight' of a Linear unit (shape (64, 64)) in two parameter groups" in got["in two groups"]
    assert "not a matrix" in got["vector added"] and "shape (3,)" in got["vector added"], got
    assert "parameter 'weight' of a Linear unit (shape (64, 64))" in got["twice added"], got  # named, not shaped
    assert got["groups after refusals"] == 1, got
    assert "momentum_buffer has shape [3, 3], not the parameter's [64, 48]" in got["load (3,3) buffer"], got
    assert "a group of another kind of optimizer" in got["load AdamW state"], got
    assert "ns_steps=1000000000 is not an int" in got["load ns_steps 10**9"], got
    assert "momentum_buffer has shape [3, 3]" in got["set_state_dict (3,3) buffer"], got
    assert got["unchanged"], got


def added_groups_job() -> dict:
    """A Muon built for the matrices, an AdamW group added later (AdamW's defaults fill it): both
    stepped, bitwise torch.optim.Muon and torch.optim.AdamW on the same gradients; then the state
    through state_dict()/load_state_dict into a new Muon, which steps on alike."""
    reference, model = matrices()[:3], sharded()
    norm = fullshard.fully_shard(nn.LayerNorm(37))
    params = list(model[:3].parameters())
    ours = Muon(params[:2], lr=0.02)
    ours.add_param_group({"params": params[2:], "use_muon": False, "lr": 0.01})
    ours.add_param_group({"params": list(norm.parameters()), "use_muon": False})
    plain_norm = nn.LayerNorm(37)
    theirs = [torch.optim.Muon(list(reference.parameters())[:2], lr=0.02),
              torch.optim.AdamW(list(reference.parameters())[2:], lr=0.01),
              torch.optim.AdamW(plain_norm.parameters())]
    mine, want = [*params, *norm.parameters()], [*reference.parameters(), *plain_norm.parameters()]
    copy = None
    for step in range(3):
        grads = gradients(step, [p.shape for p in want])
        for p, grad in zip(mine, grads):
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements)
        for q, grad in zip(want, grads):
            q.grad = grad.clone()
        (copy or ours).step()
        for t in theirs:
            t.step()
        if step == 1:  # the rest of the way by a Muon loaded from the state dict
            copy = Muon(params[:2], lr=0.02)
            copy.add_param_group({"params": params[2:], "use_muon": False, "lr": 0.01})
            copy.add_param_group({"params": list(norm.parameters()), "use_muon": False})
            copy.load_state_dict(ours.state_dict())
    return {"same": [torch.equal(p.full_tensor(), q.detach()) for p, q in zip(mine, want)],
            "kinds": [sorted(g) for g in copy.param_groups][1:]}


def test_added_groups_are_stepped_by_their_kind_and_survive_a_state_dict_round_trip(world2):
    for got in world2.run(added_groups_job):
        assert all(got["same"]), got
        assert all("betas" in keys and "momentum" not in keys for keys in got["kinds"]), got  # AdamW's keys only


def planted_job(root: str) -> dict:
    """A Muon checkpoint (a Muon group and an AdamW group), its manifest's hyperparameters replaced
    one at a time: each load refused by its kind's rules with nothing changed, then the good one
    loads and steps."""
    import json
    from pathlib import Path

    model = sharded()
    params = list(model.parameters())
    opt = Muon([{"params": params[:2]}, {"params": params[2:3], "use_muon": False}], lr=0.02)
    give(model, gradients(0, [p.shape for p in params]))
    opt.step()
    fullshard.save(root, model, opt)
    path = next(Path(root).glob("v-*/fullshard.json"))
    good = json.loads(path.read_text())
    before = [p.full_tensor().clone() for p in params]
    out = {}
    for name, key, value in (("ns_steps 2.5", "optim.param_groups.0.ns_steps", 2.5),
                             ("ns_steps 10**9", "optim.param_groups.0.ns_steps", 10**9),
                             ("coefficients 1e300", "optim.param_groups.0.ns_coefficients", [1e300, 1.0, 1.0]),
                             ("betas 2", "optim.param_groups.1.betas", [2.0, 0.999]),
                             ("betas -1", "optim.param_groups.1.betas", [-1.0, 0.999]),
                             ("eps -1", "optim.param_groups.1.eps", -1.0)):
        rewrite(path, json.dumps({**good, "values": {**good["values"], key: value}}))
        out[name] = raises(lambda: fullshard.load(root, model, opt))
    rewrite(path, json.dumps(good))
    out["unchanged"] = all(torch.equal(p.full_tensor(), b) for p, b in zip(params, before))
    fullshard.load(root, model, opt)
    opt.step()
    out["steps"] = all(torch.isfinite(p.full_tensor()).all().item() for p in params)
    return out


def test_planted_manifest_hyperparameters_are_refused_by_their_kinds_rules(world2, tmp_path):
    for got in world2.run(planted_job, root=str(tmp_path / "ckpt")):
        assert "ns_steps=2.5 is not an int" in got["ns_steps 2.5"], got
        assert "ns_steps=1000000000 is not an int" in got["ns_steps 10**9"], got
        assert "are not three finite numbers" in got["coefficients 1e300"], got
        assert "betas[0]=2.0 must be below 1" in got["betas 2"], got  # AdamW's rule, not Muon's constructor's
        assert "betas[0]=-1.0 must be at least 0" in got["betas -1"], got
        assert "eps=-1.0 must be above 0" in got["eps -1"], got
        assert got["unchanged"] and got["steps"], got
