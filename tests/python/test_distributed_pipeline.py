"""gpipe.distributed.pipeline: a module written the usual way, traced and cut at named submodules
over Gloo ranks, equals the plain module (loss, every parameter's grad, eval outputs, float64),
with the module's state_dict keys (the union over ranks) and a tie across ranks kept.

Models from test_pipeline: the GPT (tied lm_head, attention mask as a keyword not cut by batch)
on 3 ranks, the U-Net whose encoder output skips a stage on 4 ranks (the skip travels from rank
0 to rank 2), Hugging Face causal LMs with the defaults on 2 ranks, with hand-offs matched by tag (Gloo's way) and by order (NCCL's). Each test
spawns this file as worker processes (test_distributed's ``_spawn``); every rank builds the
plain model too and compares.
"""
import os
import sys
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_distributed as td  # noqa: E402
from test_pipeline import T, V, UNet, causal, gpt, idx_of, lm_loss  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "zb_h1")
_runs: dict = {}


def _run(scenario: str, world: int, handoffs: str = "tagged") -> dict:
    """Each scenario's processes run once per module (several tests read one run)."""
    key = (scenario, world, handoffs)
    if key not in _runs:
        _runs[key] = td._spawn(scenario, world, handoffs=handoffs, script=os.path.abspath(__file__))
    return _runs[key]


def _grad_error(pipe, plain) -> float:
    """The largest difference between this rank's grads and the plain model's, by the
    module's names ("0.tok.weight" is the module's "tok.weight")."""
    reference = dict(plain.named_parameters(remove_duplicate=False))
    worst = 0.0
    for name, p in pipe.named_parameters():
        ref = reference[name.split(".", 1)[1]]
        if p.grad is None or ref.grad is None:
            worst = max(worst, 0.0 if p.grad is None and ref.grad is None else float("inf"))
            continue
        worst = max(worst, (p.grad - ref.grad).abs().max().item())
    return worst


def _union_of_keys(pipe) -> list:
    import torch.distributed as dist

    keys = [None] * dist.get_world_size()
    dist.all_gather_object(keys, list(pipe.state_dict().keys()))
    return sorted(set().union(*keys))


def _worker_gpt() -> None:
    import torch.distributed as dist

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    mask = causal()
    idx, tgt = idx_of(6), idx_of(6)
    # The last pipe serves the checks below.
    for schedule in ("interleaved_1f1b", "zb_v") + SCHEDULES:
        torch.manual_seed(1)
        model = gpt()
        torch.manual_seed(1)
        plain = gpt()
        # interleaved: 6 stages, two per rank (rank r holds stages r and r + 3); zb_v: 6
        # stages in a V (rank r holds stages r and 5 - r; virtual_stages implied).
        six = schedule in ("interleaved_1f1b", "zb_v")
        split = (["blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f"] if six
                 else ["blocks.1", "blocks.3"])
        pipe = gpipe.distributed.pipeline(model, split, (idx_of(2),),
                                          {"attention_mask": mask}, chunks=3, schedule=schedule,
                                          virtual_stages=2 if schedule == "interleaved_1f1b"
                                          else 1,
                                          batch_dim={"attention_mask": None})
        loss = pipe.train_step((idx,) if pipe.is_first else None, tgt if pipe.is_last else None,
                               loss_fn=lm_loss,
                               kwargs={"attention_mask": mask} if pipe.is_first else None)
        ref = lm_loss(plain(idx, attention_mask=mask), tgt)
        ref.backward()
        td._report(check=schedule, grad_error=_grad_error(pipe, plain),
                   loss_error=abs(loss.item() - ref.item()) if pipe.is_last else 0.0,
                   stages=pipe.stages, ties=pipe.tied_parameters)

    # eval_step gives what the module returns; the state_dict's union is the module's; every
    # rank loads the module's whole state_dict.
    out = pipe.eval_step((idx,) if pipe.is_first else None,
                         kwargs={"attention_mask": mask} if pipe.is_first else None)
    with torch.no_grad():
        expected = plain(idx, attention_mask=mask)
    fresh = gpt()
    result = pipe.load_state_dict(fresh.state_dict())
    loaded = all(torch.equal(v, fresh.state_dict()[k]) for k, v in pipe.state_dict().items())
    td._report(check="state", eval_error=((out - expected).abs().max().item()
                                          if pipe.is_last else 0.0),
               eval_is_none=out is None, union=_union_of_keys(pipe),
               module_keys=sorted(model.state_dict().keys()), loaded=loaded,
               missing=result.missing_keys, unexpected=result.unexpected_keys,
               mine=list(pipe.state_dict().keys()))

    # The first rank forgetting the module's arguments fails the step on every rank.
    try:
        pipe.train_step(None, tgt if pipe.is_last else None, loss_fn=lm_loss)
        error = ""
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    td._report(check="no input", error=error)

    # Split points that do not give one stage per rank are refused before anything is built.
    try:
        gpipe.distributed.pipeline(gpt(), ["blocks.1"], (idx_of(2),))
        error = ""
    except ValueError as e:
        error = str(e)
    td._report(check="stage count", error=error)

    # Neither split points nor stages: one stage per rank, balanced; by time, every rank takes
    # the first rank's profile (timings differ between processes).
    for balance_by in ("params", "time"):
        torch.manual_seed(1)
        model = gpt()
        pipe = gpipe.distributed.pipeline(model, example_args=(idx_of(2),), chunks=2,
                                          balance_by=balance_by)
        firsts = [next(n.target for n in stage.graph.nodes if n.op == "call_module")
                  for stage in pipe.children()]
        out = pipe.eval_step(idx if pipe.is_first else None)
        with torch.no_grad():
            expected = model(idx)
        td._report(check=f"balanced by {balance_by}", firsts=firsts,
                   eval_error=(out - expected).abs().max().item() if pipe.is_last else 0.0)
    dist.destroy_process_group()


def _worker_unet() -> None:
    import torch.distributed as dist

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    x, y = torch.randn(6, 2, 8, dtype=torch.float64), torch.randn(6, 2, 8, dtype=torch.float64)
    for schedule in SCHEDULES:
        torch.manual_seed(1)
        model = UNet().double()
        torch.manual_seed(1)
        plain = UNet().double()
        pipe = gpipe.distributed.pipeline(model, example_args=x[:2], chunks=3, schedule=schedule,
                                          split_points=["enc2", "mid", "dec1"])
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                               loss_fn=F.mse_loss)
        ref = F.mse_loss(plain(x), y)
        ref.backward()
        skips = [stage.gpipe_skips for stage in pipe.children()]
        td._report(check=schedule, grad_error=_grad_error(pipe, plain),
                   loss_error=abs(loss.item() - ref.item()) if pipe.is_last else 0.0,
                   skips=[[list(map(list, side)) for side in s] if s else None for s in skips])
    dist.destroy_process_group()


def _worker_dcp() -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(1)
    model = gpt()
    pipe = gpipe.distributed.pipeline(model, ["blocks.1", "blocks.3"], (idx_of(2),), chunks=2)
    opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    torch.manual_seed(2)
    idx, tgt = idx_of(4), idx_of(4)
    pipe.train_step((idx,) if pipe.is_first else None, tgt if pipe.is_last else None,
                    loss_fn=lm_loss)
    opt.step()
    model_sd, optim_sd = gpipe.distributed.get_state_dict(pipe, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.environ["CHECKPOINT"])
    # Every value this rank saved, by the module's names, for the test to compare.
    sums = {k: v.double().sum().item() for k, v in model_sd.items()}
    sums.update({k: v.double().sum().item() for k, v in optim_sd.items()
                 if isinstance(v, torch.Tensor) and k.endswith(".exp_avg")})
    # The same dicts load back into a fresh pipe, optimizer state included.
    torch.manual_seed(3)
    other = gpipe.distributed.pipeline(gpt(), ["blocks.1", "blocks.3"], (idx_of(2),), chunks=2)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.01)
    gpipe.distributed.set_state_dict(other, other_opt, model_state_dict=model_sd,
                                     optim_state_dict=optim_sd)
    same = all(torch.equal(a, b) for a, b in zip(other.parameters(), pipe.parameters())) and all(
        torch.equal(other_opt.state[a]["exp_avg"], opt.state[b]["exp_avg"])
        for a, b in zip(other.parameters(), pipe.parameters()))
    td._report(check="dcp", keys=sorted(model_sd), sums=sums, reloaded=same)
    dist.destroy_process_group()


#: Hugging Face causal LMs over 2 ranks with the defaults (tracer="auto", split points chosen):
#: each family with 1f1b (2 stages), Llama also with zb_v (4 stages in a V).
HF_RUNS = [("llama", "1f1b"), ("qwen2", "1f1b"), ("mixtral", "1f1b"), ("gpt2", "1f1b"),
           ("llama", "zb_v")]


def _worker_hf() -> None:
    import copy

    import torch.distributed as dist

    import gpipe.distributed
    from test_pipeline_hf import causal_lm, ids, lm_loss

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    for family, schedule in HF_RUNS:
        torch.manual_seed(1)
        model = causal_lm(family, use_cache=family == "qwen2")  # (True: the config's default)
        plain = copy.deepcopy(model)
        torch.manual_seed(2)
        x, tgt = ids(6), ids(6)
        pipe = gpipe.distributed.pipeline(model, example_args=(ids(2),), chunks=3,
                                          schedule=schedule)
        loss = pipe.train_step((x,) if pipe.is_first else None, tgt if pipe.is_last else None,
                               loss_fn=lm_loss)
        ref = lm_loss(plain(x), tgt)
        ref.backward()
        td._report(check=f"{family} {schedule}", grad_error=_grad_error(pipe, plain),
                   loss_error=abs(loss.item() - ref.item()) if pipe.is_last else 0.0,
                   split_points=pipe.split_points, tracer=pipe.tracer, stages=pipe.stages,
                   ties=pipe.tied_parameters)
    dist.destroy_process_group()


@pytest.mark.parametrize("schedule", SCHEDULES + ("interleaved_1f1b", "zb_v"))
def test_gpt_over_three_ranks_equals_the_module(schedule):
    found = td._results(_run("gpt", 3), schedule)
    for rank, r in found.items():
        assert r["grad_error"] <= 1e-10, (rank, r)
        assert r["loss_error"] <= 1e-10, (rank, r)
        if schedule == "zb_v":
            # A V: the first and the last stage (the embedding and the head that reuses its
            # weight) on rank 0, so the tie needs no exchange.
            assert r["stages"] == [rank, 5 - rank], (rank, r)
            assert r["ties"] == [], (rank, r)
            continue
        last = 5 if schedule == "interleaved_1f1b" else 2
        assert r["stages"] == ([rank, rank + 3] if last == 5 else [rank]), (rank, r)
        # lm_head reuses the token embedding: tied across the first and the last rank.
        assert r["ties"] == [[["0.tok.weight", f"{last}.lm_head.weight"], [0, 2]]], (rank, r)


def test_gpt_state_dict_union_eval_and_loading():
    found = td._results(_run("gpt", 3), "state")
    for rank, r in found.items():
        assert r["union"] == r["module_keys"], (rank, r)
        assert r["loaded"] and r["missing"] == [] and r["unexpected"] == [], (rank, r)
        assert (r["eval_is_none"], r["eval_error"] <= 1e-10) == (rank != 2, True), (rank, r)
    assert "tok.weight" in found[0]["mine"] and "lm_head.weight" in found[2]["mine"]
    assert "blocks.3.ln1.weight" in found[2]["mine"] and "blocks.3.ln1.weight" not in found[0]["mine"]


def test_gpt_errors_name_the_fix():
    found = td._results(_run("gpt", 3), "no input")
    assert "holds the first stage" in found[0]["error"], found[0]
    for rank in (1, 2):
        assert "rank 0" in found[rank]["error"], (rank, found[rank])
    for rank, r in td._results(_run("gpt", 3), "stage count").items():
        assert "2 stages" in r["error"] and "pass 2 split points" in r["error"], (rank, r)


def test_dcp_checkpoint_of_the_pipes_loads_into_the_plain_module(tmp_path):
    # torch.distributed.checkpoint names parameters by named_parameters() ('2.ln_f.weight'):
    # gpipe.distributed.get_state_dict renames them to the module's keys, so the ranks'
    # checkpoint loads into the plain module (here in this process, without a group).
    import torch.distributed.checkpoint as dcp

    import gpipe.distributed

    path = str(tmp_path / "checkpoint")
    run = td._spawn("dcp", 3, script=os.path.abspath(__file__), CHECKPOINT=path)
    found = td._results(run, "dcp")
    plain = gpt()
    opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    for p in plain.parameters():  # the optimizer's state exists, to be filled in
        p.grad = torch.zeros_like(p)
    opt.step()
    model_sd, optim_sd = gpipe.distributed.get_state_dict(plain, opt)
    assert sorted(set().union(*[r["keys"] for r in found.values()])) == sorted(model_sd)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    gpipe.distributed.set_state_dict(plain, opt, model_state_dict=state["model"],
                                     optim_state_dict=state["optim"])
    mine = {k: v.double().sum().item() for k, v in plain.state_dict().items()}
    # (The tied head's replica on the last rank saved its state under 'lm_head.weight': the
    # replicas are equal, so the plain module's one parameter matches both.)
    mine.update({f"state.{n}.exp_avg": opt.state[p]["exp_avg"].double().sum().item()
                 for n, p in plain.named_parameters(remove_duplicate=False)})
    for rank, r in found.items():
        assert r["reloaded"], (rank, r)
        for key, value in r["sums"].items():
            assert abs(mine[key] - value) <= 1e-12 * max(1.0, abs(value)), (rank, key)


@pytest.mark.parametrize("balance_by", ["params", "time"])
def test_stages_balanced_without_split_points(balance_by):
    found = td._results(_run("gpt", 3), f"balanced by {balance_by}")
    for rank, r in found.items():
        assert r["eval_error"] <= 1e-10, (rank, r)
        assert len(r["firsts"]) == 1, (rank, r)  # one stage here
    firsts = [found[rank]["firsts"][0] for rank in sorted(found)]
    assert firsts[0] == "tok", firsts
    if balance_by == "params":  # tok (tied: counted once) + pos, then 4 equal blocks
        assert firsts == ["tok", "blocks.1", "blocks.3"], firsts


@pytest.mark.parametrize("handoffs", ["tagged", "ordered"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_unet_skip_across_ranks_equals_the_module(schedule, handoffs):
    found = td._results(_run("unet", 4, handoffs), schedule)
    for rank, r in found.items():
        assert r["grad_error"] <= 1e-10, (rank, r)
        assert r["loss_error"] <= 1e-10, (rank, r)
    # Rank 0 stashes the encoder output; rank 2 pops it; rank 1 never holds it.
    assert found[0]["skips"] == [[[[None, "enc1>2"]], []]], found[0]
    assert found[1]["skips"] == [None], found[1]
    assert found[2]["skips"] == [[[], [[None, "enc1>2"]]]], found[2]


@pytest.mark.parametrize("family,schedule", HF_RUNS)
def test_hugging_face_defaults_over_two_ranks_equal_the_module(family, schedule):
    # Issue 45: no tracer, no split points; torch.fx cannot trace transformers' mask code, so
    # every rank exports; the split points fall inside the layers and agree across ranks.
    pytest.importorskip("transformers")
    found = td._results(_run("hf", 2), f"{family} {schedule}")
    layers = "transformer.h." if family == "gpt2" else "model.layers."
    for rank, r in found.items():
        assert r["grad_error"] <= 1e-10, (rank, r)
        assert r["loss_error"] <= 1e-10, (rank, r)
        assert r["tracer"] == "export", (rank, r)
        assert r["split_points"] == found[0]["split_points"], (rank, r)
        assert all(sp.startswith(layers) for sp in r["split_points"]), (rank, r)
        if schedule == "zb_v":  # embedding and head both on rank 0: no tie across ranks
            assert len(r["split_points"]) == 3 and r["stages"] == [rank, 3 - rank], (rank, r)
            assert r["ties"] == [], (rank, r)
        else:  # the head tied to the embedding across the two ranks
            assert len(r["split_points"]) == 1 and r["stages"] == [rank], (rank, r)
            assert [ranks for _, ranks in r["ties"]] == [[0, 1]], (rank, r)


if __name__ == "__main__":
    {"gpt": _worker_gpt, "unet": _worker_unet, "dcp": _worker_dcp,
     "hf": _worker_hf}[sys.argv[1]]()
