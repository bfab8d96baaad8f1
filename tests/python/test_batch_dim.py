"""Where a batch is cut: batch_dim, values not cut, outputs of their own sizes, edge batches."""
import copy

import pytest
import torch
from torch import nn

import gpipe
from conftest import MODES, assert_close, assert_same_grads, compare_with_plain


def seq_first_model() -> nn.Sequential:
    """PyTorch's default Transformer layout: [seq, batch, features] (batch_first=False)."""
    return nn.Sequential(
        nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0),
        nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0),
        nn.Linear(8, 3),
    ).double()


@pytest.mark.parametrize("checkpoint", MODES)
def test_sequence_first_transformer_cut_along_dim_1(checkpoint: str) -> None:
    x = torch.randn(5, 6, 8, dtype=torch.float64, requires_grad=True)
    compare_with_plain(seq_first_model(), x, balance=[1, 2], devices=["cpu", "cpu"], chunks=3,
                       checkpoint=checkpoint, batch_dim=1)


def test_default_dim_0_cuts_the_sequence_of_a_sequence_first_model() -> None:
    # Why the option exists: dim 0 (the default) would cut the sequence, and
    # attention would no longer see every position.
    model = seq_first_model()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, [1, 2], devices=["cpu", "cpu"], chunks=3)
    x = torch.randn(6, 6, 8, dtype=torch.float64)
    assert (pipe(x) - ref(x)).abs().max().item() > 1e-3


class Lookup(nn.Module):
    """(x, table) -> x @ table: the table is shared by every row."""

    def forward(self, xs):  # type: ignore[no-untyped-def]
        x, table = xs
        return x @ table


def test_a_value_that_is_not_cut_reaches_every_microbatch_and_its_grad_is_summed() -> None:
    model = nn.Sequential(Lookup(), nn.Linear(3, 2)).double()
    x = torch.randn(7, 5, dtype=torch.float64)
    table = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    compare_with_plain(model, (x, table), balance=[1, 1], devices=["cpu", "cpu"], chunks=4,
                       batch_dim=[0, None])


class Masked(nn.Module):
    """(x, mask) -> (x * mask, mask): the mask passes through."""

    def forward(self, xs):  # type: ignore[no-untyped-def]
        x, mask = xs
        return x * mask, mask


def test_an_output_that_is_not_joined_comes_from_microbatch_0() -> None:
    pipe = gpipe.Pipe(nn.Sequential(Masked()), [1], devices=["cpu"], chunks=2,
                      batch_dim=[1, None], output_batch_dim=[1, None])
    x = torch.randn(2, 4, dtype=torch.float64)
    mask = torch.randn(2, 1, dtype=torch.float64)
    out, mask_out = pipe((x, mask))
    assert_close(out, x * mask)
    assert torch.equal(mask_out, mask)


class TwoSizes(nn.Module):
    def forward(self, x):  # type: ignore[no-untyped-def]
        return x, x.repeat(2, 1)


def test_outputs_keep_their_own_row_counts_in_forward_and_backward() -> None:
    model = nn.Sequential(nn.Linear(3, 3), TwoSizes()).double()
    ref = copy.deepcopy(model)
    pipe = gpipe.Pipe(model, [1, 1], devices=["cpu", "cpu"], chunks=3)
    x = torch.randn(7, 3, dtype=torch.float64)
    a, b = pipe(x)
    a_ref, b_ref = ref(x)
    assert_close(a, a_ref)
    # Joined micro-batch by micro-batch: each one's repeat in turn.
    assert_close(b, torch.cat([p.repeat(2, 1) for p in a_ref.tensor_split(3)]))
    (a.sum() + b.pow(2).sum()).backward()
    (a_ref.sum() + b_ref.pow(2).sum()).backward()
    assert_same_grads(pipe, ref)


class Total(nn.Module):
    def forward(self, x):  # type: ignore[no-untyped-def]
        return x.pow(2).sum()


def test_a_0_dim_output_with_one_chunk_works_and_with_several_is_explained() -> None:
    model = nn.Sequential(nn.Linear(3, 3), Total()).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    compare_with_plain(copy.deepcopy(model), x, balance=[1, 1], devices=["cpu", "cpu"])
    pipe = gpipe.Pipe(model, [1, 1], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(ValueError, match="0-dimensional.*after the Pipe"):
        pipe(x)


def test_a_0_row_batch_with_several_chunks_works_like_the_plain_model() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    x = torch.randn(0, 3, dtype=torch.float64, requires_grad=True)
    compare_with_plain(model, x, balance=[2, 1], devices=["cpu", "cpu"], chunks=4)


def test_an_empty_sequential_is_the_identity() -> None:
    pipe = gpipe.Pipe(nn.Sequential())
    x = torch.randn(3, 2)
    assert pipe(x) is nn.Sequential()(x) is x
    assert pipe.balance == [] and len(pipe) == 0


def test_an_uneven_batch_makes_chunks_microbatches_differing_by_at_most_one_row() -> None:
    sizes = []

    class Sizes(nn.Module):
        def forward(self, x):  # type: ignore[no-untyped-def]
            sizes.append(x.shape[0])
            return x

    pipe = gpipe.Pipe(nn.Sequential(Sizes()), [1], devices=["cpu"], chunks=16)
    with torch.no_grad():
        pipe(torch.randn(17, 2))
    assert sizes == [2] + [1] * 15


@pytest.mark.parametrize("bad, error, words", [
    (True, TypeError, "ints"), ("1", TypeError, "ints"), (None, TypeError, "inside a list"),
    ([], ValueError, "empty"), ([0, 1.5], TypeError, "1.5"),
])
def test_bad_batch_dims_are_named(bad: object, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        gpipe.Pipe(nn.Sequential(nn.Linear(2, 2)), [1], devices=["cpu"], batch_dim=bad)


def test_batch_dims_that_do_not_fit_the_input_are_named_with_the_fix() -> None:
    pipe = gpipe.Pipe(nn.Sequential(nn.Linear(2, 2)), [1], devices=["cpu"], chunks=2,
                      batch_dim=2)
    with pytest.raises(IndexError, match=r"batch_dim 2 is out of range for input 0.*\[-2, 2\)"):
        pipe(torch.randn(4, 2))
    pipe = gpipe.Pipe(nn.Sequential(Lookup()), [1], devices=["cpu"], chunks=2,
                      batch_dim=[0, None, 0])
    with pytest.raises(ValueError, match="batch_dim has 3 entries but the input has 2 values"):
        pipe((torch.randn(4, 2), torch.randn(2, 2)))


def test_repr_shows_a_batch_dim_that_is_not_the_default() -> None:
    pipe = gpipe.Pipe(nn.Sequential(nn.Linear(2, 2)), [1], devices=["cpu"], batch_dim=1)
    assert "batch_dim=1" in repr(pipe)
