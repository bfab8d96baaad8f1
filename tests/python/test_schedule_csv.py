"""Schedules as data (issue 26 item 2): torch.distributed.pipelining's CSV action tables run as
``schedule=gpipe.Schedule(...)``, in-process and over Gloo ranks, exactly as the plain model;
``pipe.schedule_csv()`` exports the table a pipe runs, which torch's own parser reads. The Gloo
job also runs a checkpoint mode per stage over the ranks (issue 26 item 3)."""
import copy
import os
import sys

import pytest
import torch
from torch import nn

import gpipe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_distributed as td  # noqa: E402

# 1F1B over 2 rows and 3 micro-batches as torch writes it: idle ticks are empty cells.
ONE_F_ONE_B = "0F0,0F1,,0B0,0F2,0B1,,0B2\n,1F0,1B0,1F1,1B1,1F2,1B2\n"
# A zero-bubble table written by hand: B split into I and W, the W's late.
ZERO_BUBBLE = "0F0,0F1,0I0,0F2,0I1,0I2,0W0,0W1,0W2\n1F0,1I0,1F1,1I1,1W0,1F2,1I2,1W1,1W2\n"
# zb_v's table for 2 rows and 3 micro-batches (as gpipe exports it): 4 stages in a V.
V_TABLE = ("0F0,0F1,3F0,3I0,3F1,3I1,0I0,3W0,0I1,3W1,0W0,0F2,0W1,3F2,3I2,3W2,0I2,0W2\n"
           "1F0,2F0,1F1,2F1,2I0,1I0,2I1,1I1,2W0,1W0,2W1,1W1,1F2,2F2,2I2,1I2,2W2,1W2\n")


def model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU(),
                         nn.Linear(6, 4)).double()


def train(pipe_or_model, steps=2, step=None):
    """Two SGD steps; the losses and the parameters after them."""
    torch.manual_seed(9)
    data = [(torch.randn(9, 5, dtype=torch.double), torch.randn(9, 4, dtype=torch.double))
            for _ in range(steps)]
    opt = torch.optim.SGD(pipe_or_model.parameters(), lr=0.1)
    losses = []
    for x, y in data:
        opt.zero_grad()
        if step is None:
            loss = nn.functional.mse_loss(pipe_or_model(x), y)
            loss.backward()
        else:
            loss = step(x, y)
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in pipe_or_model.parameters()]


def train_pipe(pipe):
    return train(pipe, step=lambda x, y: pipe.train_step(x, y, nn.functional.mse_loss))


def trains_as_the_plain_model(schedule, balance, checkpoint):
    """A Pipe on 2 CPU devices running `schedule`, trained two steps: losses and parameters
    equal the plain model's (1e-10). Returns the Pipe."""
    pipe = gpipe.Pipe(model(), balance=balance, devices=["cpu", "cpu"], chunks=3,
                      checkpoint=checkpoint, schedule=schedule)
    want_losses, want_params = train(model())
    losses, params = train_pipe(pipe)
    assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-10
    for got, want in zip(params, want_params):
        assert (got - want).abs().max().item() <= 1e-10
    return pipe


@pytest.mark.parametrize("text", [ONE_F_ONE_B, ZERO_BUBBLE], ids=["1f1b", "zero-bubble"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_csv_table_trains_as_the_plain_model(text, checkpoint):
    schedule = gpipe.Schedule(text)
    assert (schedule.rows, schedule.stages, schedule.microbatches) == (2, 2, 3)
    pipe = trains_as_the_plain_model(schedule, [3, 2], checkpoint)
    assert pipe.schedule_csv() == text.replace(",,", ",").replace("\n,", "\n").replace(" ", "")


@pytest.mark.parametrize("name,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2),
                                          ("zb_h1", 1), ("zb_v", 2)])
def test_every_built_in_schedule_exported_and_loaded_back_runs_bitwise_the_same(name, virtual):
    balance = [2, 1, 1, 1] if virtual == 1 else [2, 1, 1, 1]  # 4 devices, or 2 x 2 stages
    devices = ["cpu"] * (len(balance) // virtual)
    seq = model()
    built_in = gpipe.Pipe(copy.deepcopy(seq), balance=balance, devices=devices, chunks=4,
                          schedule=name, virtual_stages=virtual)
    table = gpipe.Schedule(built_in.schedule_csv())
    assert table.stages == len(balance) and table.rows == len(devices)
    # zb_v's table places its stages in a V (row 0: stages 0 and 3), and runs so.
    assert table.v_shaped == (name == "zb_v")
    loaded = gpipe.Pipe(copy.deepcopy(seq), balance=balance, devices=devices, chunks=4,
                        schedule=table)
    assert loaded.virtual_stages == virtual
    assert loaded.schedule_csv() == built_in.schedule_csv()
    a, b = train_pipe(built_in), train_pipe(loaded)
    assert a[0] == b[0]
    assert all(torch.equal(p, q) for p, q in zip(a[1], b[1]))


# A DualPipeV-style table written by hand: 4 stages in a V on 2 rows, whole backwards (B)
# beside split ones (I, W), and torch's overlapped F/B cells, which gpipe runs as their two
# actions in order.
DUALPIPE_V = ("0F0,0F1,3F0,3B0,3F1,(0F2;3B1)OVERLAP_F_B,(3F2;0B0)OVERLAP_F_B,3B2,0B1,0B2\n"
              "1F0,2F0,1F1,2F1,2B0,(1F2;2B1)OVERLAP_F_B,1B0,2F2,2B2,1I1,1I2,1W1,1W2\n")


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_dualpipe_v_table_with_overlapped_cells_trains_as_the_plain_model(checkpoint):
    schedule = gpipe.Schedule(DUALPIPE_V)
    assert (schedule.rows, schedule.stages, schedule.microbatches) == (2, 4, 3)
    assert schedule.v_shaped
    pipe = trains_as_the_plain_model(schedule, [2, 1, 1, 1], checkpoint)
    # Exported, each pair is its two actions.
    assert pipe.schedule_csv().splitlines()[0] == "0F0,0F1,3F0,3B0,3F1,0F2,3B1,3F2,0B0,3B2,0B1,0B2"


def test_torchs_parser_reads_what_gpipe_writes(tmp_path):
    from torch.distributed.pipelining.schedules import _Action

    pipe = gpipe.Pipe(model(), balance=[2, 2, 1], devices=["cpu"] * 3, chunks=4,
                      schedule="zb_h1")
    path = tmp_path / "zb.csv"
    gpipe.Schedule(pipe.schedule_csv()).save(path)
    rows = [line.split(",") for line in path.read_text().splitlines()]
    actions = [[_Action.from_str(a) for a in row] for row in rows]
    assert [[repr(a) for a in row] for row in actions] == rows
    assert {a.computation_type.value for row in actions for a in row} == {"F", "I", "W"}
    assert gpipe.Schedule.from_csv(path) == gpipe.Schedule(pipe.schedule_csv())


def test_from_rows_takes_torchs_pipeline_order_with_idle_ticks():
    rows = [["0F0", "0F1", None, "0B0", "0F2", "0B1", None, "0B2"],
            [None, "1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]]
    assert gpipe.Schedule.from_rows(rows) == gpipe.Schedule(ONE_F_ONE_B)
    assert gpipe.Schedule(ONE_F_ONE_B).to_rows() == [[a for a in row if a] for row in rows]


@pytest.mark.parametrize("text,words", [
    ("0F0,0Q1\n", ["row 0, cell 1 ('0Q1') is not an action", "'0F3'"]),
    ("0F0,0SEND_F0,0B0\n", ["SEND_F is not a compute action", "compute_only"]),
    ("0F0,1F0,1B0,0B0\n2F0,3F0,3B0,2B0\n", ["runs stage 1 on row 0, but gpipe runs stage s on "
                                            "row s mod 2, or 4 stages in a V",
                                            "move stage 1's actions to row 1"]),
    ("0F0,0F1,0B0\n1F0,1F1,1B0,1B1\n", ["B(stage 0, micro-batch 1) is missing"]),
    ("0B0,0F0\n1F0,1B0\n", ["deadlock"]),
])
def test_a_bad_table_is_refused_naming_the_actions(text, words):
    with pytest.raises(ValueError) as e:
        gpipe.Schedule(text)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_a_table_that_does_not_fit_the_pipe_is_refused():
    schedule = gpipe.Schedule(ONE_F_ONE_B)
    with pytest.raises(ValueError, match="the schedule runs 3 micro-batches but chunks is 4; "
                                         "pass chunks=3"):
        gpipe.Pipe(model(), balance=[3, 2], devices=["cpu"] * 2, chunks=4, schedule=schedule)
    with pytest.raises(ValueError, match="the schedule has 2 rows but the pipe runs on 3 devices"):
        gpipe.Pipe(model(), balance=[2, 2, 1], devices=["cpu"] * 3, chunks=3, schedule=schedule)
    with pytest.raises(ValueError, match="virtual_stages is 3 but the schedule's table runs 1"):
        gpipe.Pipe(model(), balance=[3, 2], chunks=3, schedule=schedule, virtual_stages=3)
    with pytest.raises(TypeError, match="Schedule takes the CSV text"):
        gpipe.Schedule(["0F0"])  # type: ignore[arg-type]
    # A batch too small for the table's micro-batches: refused, and the pipe trains on.
    pipe = gpipe.Pipe(model(), balance=[3, 2], devices=["cpu"] * 2, chunks=3, schedule=schedule)
    with pytest.raises(ValueError, match="this batch makes 2 micro-batches"):
        pipe.train_step(torch.randn(2, 5, dtype=torch.double),
                        torch.randn(2, 4, dtype=torch.double), nn.functional.mse_loss)
    assert train_pipe(pipe)[0]


def test_a_pipe_with_a_table_pickles():
    import pickle

    pipe = gpipe.Pipe(model(), balance=[3, 2], chunks=3, schedule=gpipe.Schedule(ZERO_BUBBLE))
    twin = pickle.loads(pickle.dumps(pipe))
    assert twin.schedule == pipe.schedule and twin.schedule_csv() == pipe.schedule_csv()
    assert train_pipe(twin)[0] == train_pipe(copy.deepcopy(pipe))[0]


# -- over Gloo ranks ---------------------------------------------------------------------------

def _worker_csv() -> None:
    from datetime import timedelta

    import torch.distributed as dist

    import gpipe.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    runs = (("1f1b", ONE_F_ONE_B, "except_last"), ("zero-bubble", ZERO_BUBBLE, "except_last"),
            # A checkpoint mode per stage (issue 26 item 3), over the ranks.
            ("stage-checkpoints", ONE_F_ONE_B, ["always", "never"]),
            # A table placing 4 stages in a V (zb_v's): rank 0 holds stages 0 and 3.
            ("v", V_TABLE, "except_last"),
            # DualPipeV's overlapped cells, in the same V.
            ("dualpipe-v", DUALPIPE_V, "always"))
    for name, text, checkpoint in runs:
        want_losses, want_params = train(model())
        balance = [2, 1, 1, 1] if name in ("v", "dualpipe-v") else [3, 2]
        pipe = gpipe.distributed.Pipe(model(), balance, chunks=3, schedule=gpipe.Schedule(text),
                                      checkpoint=checkpoint)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        torch.manual_seed(9)
        losses = []
        for _ in range(2):
            x, y = torch.randn(9, 5, dtype=torch.double), torch.randn(9, 4, dtype=torch.double)
            opt.zero_grad()
            loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                                   loss_fn=nn.functional.mse_loss)
            opt.step()
            losses.append(None if loss is None else loss.item())
        reference = dict(model().named_parameters())
        errors = [max(abs(a - b) for a, b in zip(losses, want_losses) if a is not None)
                  if pipe.is_last else 0.0]
        want = dict(zip(reference, want_params))
        errors += [(p - want[n]).abs().max().item() for n, p in pipe.named_parameters()]
        td._report(check=name, error=max(errors), csv=pipe.schedule_csv(), stages=pipe.stages)
    dist.destroy_process_group()


def test_a_csv_table_over_two_gloo_ranks():
    run = td._spawn("csv", world=2, script=__file__)
    assert run["codes"] == [0, 0], run["logs"]
    for name, text in (("1f1b", ONE_F_ONE_B), ("zero-bubble", ZERO_BUBBLE),
                       ("stage-checkpoints", ONE_F_ONE_B), ("v", V_TABLE),
                       ("dualpipe-v", DUALPIPE_V)):
        for rank, r in td._results(run, name).items():
            assert r["error"] <= 1e-10, (name, rank, r)
            assert r["csv"] == gpipe.Schedule(text).csv, (name, rank, r)
    for name in ("v", "dualpipe-v"):
        assert [td._results(run, name)[r]["stages"] for r in (0, 1)] == [[0, 3], [1, 2]]


if __name__ == "__main__":
    {"csv": _worker_csv}[sys.argv[1]]()
