"""Checkpoints that reshard: a pipe's model and AdamW state saved with torch.distributed.checkpoint
(DCP) on 4 Gloo ranks with one balance, loaded on 2 ranks with another, into an in-process
gpipe.Pipe, and into the plain Sequential; each continuation equals the plain model trained
without a break (float64).

The model is test_distributed_ranks' GPT, whose lm_head reuses the token embedding (a tie across
the first and the last rank). gpipe.distributed.get_state_dict / set_state_dict are torch's with
the optimizer state flattened (see their docstrings). Each launch runs this file as worker
processes (test_distributed's ``_spawn``); the checkpoint goes to a pytest temporary folder.
"""
import os
import sys
from datetime import timedelta

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_distributed as td  # noqa: E402
from test_distributed_ranks import SEQ, VOCAB, _gpt, _loss  # noqa: E402

STEPS = 4
SAVED_AFTER = 2
LR = 0.01


def _batches():
    torch.manual_seed(1)
    return [(torch.randint(0, VOCAB, (8, SEQ)), torch.randint(0, VOCAB, (8, SEQ)))
            for _ in range(STEPS)]


def _uninterrupted():
    """The plain model and its AdamW after every step, without a break."""
    plain = _gpt()
    opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    for x, y in _batches():
        opt.zero_grad()
        _loss(plain(x), y).backward()
        opt.step()
    return plain, opt


def _errors(model, opt, reference, reference_opt):
    """Worst difference of `model`'s parameters and AdamW moments from the reference's, by
    parameter name."""
    params = dict(reference.named_parameters(remove_duplicate=False))
    moments = {name: reference_opt.state[p] for name, p in params.items()}
    param_error = state_error = 0.0
    for name, p in model.named_parameters():
        param_error = max(param_error, (p - params[name]).abs().max().item())
        for key in ("exp_avg", "exp_avg_sq"):
            state_error = max(state_error,
                              (opt.state[p][key] - moments[name][key]).abs().max().item())
        state_error = max(state_error,
                          abs(float(opt.state[p]["step"]) - float(moments[name]["step"])))
    return param_error, state_error


def _train(pipe, opt, steps, distributed: bool):
    data = _batches()
    for k in steps:
        x, y = data[k]
        opt.zero_grad()
        if distributed:
            pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                            loss_fn=_loss)
        else:
            _loss(pipe(x), y).backward()
        opt.step()


def _worker_save() -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    pipe = gpipe.distributed.Pipe(_gpt(), [2, 2, 2, 2], chunks=4)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    _train(pipe, opt, range(SAVED_AFTER), True)
    model_sd, optim_sd = gpipe.distributed.get_state_dict(pipe, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.environ["GPIPE_TEST_DIR"])
    td._report(check="saved", keys=sorted(model_sd))
    dist.destroy_process_group()


def _worker_resume() -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    pipe = gpipe.distributed.Pipe(_gpt(), [5, 3], chunks=4)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    model_sd, optim_sd = gpipe.distributed.get_state_dict(pipe, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.environ["GPIPE_TEST_DIR"])
    gpipe.distributed.set_state_dict(pipe, opt, model_state_dict=model_sd,
                                     optim_state_dict=optim_sd)
    _train(pipe, opt, range(SAVED_AFTER, STEPS), True)
    param_error, state_error = _errors(pipe, opt, *_uninterrupted())
    td._report(check="resumed", param_error=param_error, state_error=state_error,
               names=sorted(n for n, _ in pipe.named_parameters()))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("dcp") / "step2")
    run = td._spawn("save", 4, script=os.path.abspath(__file__), GPIPE_TEST_DIR=folder)
    found = td._results(run, "saved")
    names = sorted(n for n, _ in _gpt().named_parameters(remove_duplicate=False))
    for rank, r in found.items():
        # Each rank's keys are its layers' names in the Sequential, tied replicas included.
        assert set(r["keys"]) <= set(names), (rank, r)
    assert set().union(*(r["keys"] for r in found.values())) == set(names)
    return folder


def test_saved_on_4_ranks_resumes_on_2_with_another_balance(saved):
    run = td._spawn("resume", 2, script=os.path.abspath(__file__), GPIPE_TEST_DIR=saved)
    found = td._results(run, "resumed")
    for rank, r in found.items():
        assert r["param_error"] <= 1e-12, (rank, r)
        assert r["state_error"] <= 1e-12, (rank, r)
    # The tied weight on both ranks: the embedding on rank 0, the lm_head on rank 1.
    assert "0.tok.weight" in found[0]["names"] and "7.out.weight" in found[1]["names"]


def _load(model, opt, folder):
    import torch.distributed.checkpoint as dcp

    import gpipe.distributed

    model_sd, optim_sd = gpipe.distributed.get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)
    gpipe.distributed.set_state_dict(model, opt, model_state_dict=model_sd,
                                     optim_state_dict=optim_sd)


def test_saved_on_4_ranks_resumes_in_an_in_process_pipe(saved):
    import gpipe

    pipe = gpipe.Pipe(_gpt(), balance=[3, 5], chunks=4)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    _load(pipe, opt, saved)
    _train(pipe, opt, range(SAVED_AFTER, STEPS), False)
    param_error, state_error = _errors(pipe, opt, *_uninterrupted())
    assert param_error <= 1e-12 and state_error <= 1e-12, (param_error, state_error)


def test_saved_on_4_ranks_resumes_in_the_plain_sequential(saved):
    plain = _gpt()
    opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    _load(plain, opt, saved)
    _train(plain, opt, range(SAVED_AFTER, STEPS), False)
    param_error, state_error = _errors(plain, opt, *_uninterrupted())
    assert param_error <= 1e-12 and state_error <= 1e-12, (param_error, state_error)
    # The tie survived the load: one Parameter.
    assert plain[0].tok.weight is plain[7].out.weight


EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                       "examples", "checkpoint_distributed.py")


def test_example_saves_on_4_ranks_and_resumes_on_2(tmp_path):
    """README's commands: examples/checkpoint_distributed.py --save under torchrun on 4
    processes, then --resume on 2."""
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    folder = str(tmp_path / "ckpt")
    outputs = []
    for world, flag in ((4, "--save"), (2, "--resume")):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                               str(world), "--master-port", str(td._free_port()), EXAMPLE, flag,
                               folder], env=env, capture_output=True, text=True,
                              timeout=td.SPAWN_DEADLINE)
        outputs.append(done.stdout + done.stderr)
        assert done.returncode == 0, outputs[-1]
    assert outputs[0].count("saved stages") == 4, outputs[0]
    assert outputs[1].count(": OK") == 2, outputs[1]
    assert "step 5: loss" in outputs[1], outputs[1]


def test_options_must_be_torchs():
    import gpipe.distributed

    plain = _gpt()
    opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    with pytest.raises(TypeError, match="StateDictOptions"):
        gpipe.distributed.get_state_dict(plain, opt, options={"full_state_dict": True})


if __name__ == "__main__":
    {"save": _worker_save, "resume": _worker_resume}[sys.argv[1]]()
