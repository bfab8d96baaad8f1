"""Batch norm whose running statistics cover a whole mini-batch, not each micro-batch."""
import copy
from typing import Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gpipe._C import is_recomputing

__all__ = ["DeferredBatchNorm", "convert_deferred_batch_norm"]


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm that normalises each micro-batch by its own statistics
    (as plain BatchNorm does with a smaller batch) but updates the running
    mean and (unbiased) running variance once per mini-batch, from the
    statistics of all its micro-batches together. A recompute does not count
    twice. The Pipe tells it how many micro-batches each mini-batch has.

    The constructor and :meth:`convert_deferred_batch_norm` take torchgpipe's
    arguments. Unlike torchgpipe's, the running variance is the exact
    unbiased variance of the mini-batch (as plain BatchNorm's over the whole
    mini-batch), and the sums are not buffers, so ``state_dict()`` keys are
    plain BatchNorm's.

    Args:
        num_features: channels, as ``nn.BatchNorm1d``'s.
        eps: added to the variance, as BatchNorm's.
        momentum: the running statistics' update factor, or None for a
            cumulative average, as BatchNorm's.
        affine: learn a weight and bias, as BatchNorm's.
        chunks: micro-batches per mini-batch until the Pipe says otherwise
            (torchgpipe's name; also :attr:`microbatches`).
    """

    #: Micro-batches in the current mini-batch (set by :meth:`begin`).
    microbatches: int

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, chunks: int = 1) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.microbatches = chunks
        self._reset_sums()

    @property
    def chunks(self) -> int:
        """torchgpipe's name for :attr:`microbatches`."""
        return self.microbatches

    @chunks.setter
    def chunks(self, chunks: int) -> None:
        self.microbatches = chunks

    def begin(self, microbatches: int) -> None:
        """Starts a mini-batch of ``microbatches`` micro-batches (the Pipe calls this)."""
        self.microbatches = microbatches
        self._reset_sums()

    def _reset_sums(self) -> None:
        self._mean: Optional[torch.Tensor] = None
        self._m2: Optional[torch.Tensor] = None
        self._count = 0
        self._seen = 0

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() <= 1:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalizes ``input`` with its own micro-batch's statistics in
        training (BatchNorm's running statistics in eval); the running
        statistics are updated once, when the mini-batch's last micro-batch
        has been seen."""
        self._check_input_dim(input)
        if not self.training:
            return super().forward(input)
        if not is_recomputing():
            self._track(input)
        # Normalise by this micro-batch's own statistics, leaving the running
        # statistics alone (they are committed once per mini-batch).
        return nn.functional.batch_norm(input, None, None, self.weight, self.bias, True, 0.0,
                                        self.eps)

    @torch.no_grad()
    def _track(self, input: torch.Tensor) -> None:
        # Each micro-batch's count, mean and sum of squares about its own mean,
        # merged into the mini-batch's (Chan et al.'s pairwise update): no
        # E[x²] − E[x]², which loses every digit of a variance far below the
        # squared mean. Half precision accumulates in float32, as BatchNorm's.
        dims = [0] + list(range(2, input.dim()))
        x = input.detach()
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        count = x.numel() // x.size(1)
        mean = x.mean(dims)
        m2 = (x - mean.view([1, -1] + [1] * (x.dim() - 2))).pow(2).sum(dims)
        if self._mean is None or self._m2 is None:
            self._mean, self._m2 = mean, m2
        else:
            total = self._count + count
            delta = mean - self._mean
            self._mean = self._mean + delta * (count / total)
            self._m2 = self._m2 + m2 + delta * delta * (self._count * count / total)
        self._count += count
        self._seen += 1
        if self._seen >= self.microbatches:
            self._commit()

    def _commit(self) -> None:
        assert self._mean is not None and self._m2 is not None
        n = self._count
        mean = self._mean
        unbiased = self._m2 / max(n - 1, 1)
        self.num_batches_tracked += 1
        if self.momentum is None:
            factor = 1.0 / float(self.num_batches_tracked)
        else:
            factor = self.momentum
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        self._reset_sums()

    @classmethod
    def convert(cls, module: nn.Module, microbatches: int = 1) -> nn.Module:
        """Returns ``module`` with every BatchNorm (1d, 2d, 3d) replaced, in
        place, by a DeferredBatchNorm holding the same parameters and buffers
        (a BatchNorm passed itself is returned converted). A DeferredBatchNorm
        for ``microbatches`` stays as it is; one for another count is replaced
        by one for ``microbatches``, as torchgpipe's. ``gpipe.Pipe``
        leaves its caller's model alone instead (converted copies of the BatchNorms and of the containers holding them)."""
        return _convert(cls, module, microbatches, in_place=True)

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module, chunks: int = 1) -> nn.Module:
        """torchgpipe's name for :meth:`convert`: ``module`` with every
        BatchNorm replaced, in place, by a DeferredBatchNorm for ``chunks``
        micro-batches (a BatchNorm passed itself is returned converted)."""
        return cls.convert(module, chunks)


def _converted_batch_norm(cls: type, module: _BatchNorm, microbatches: int) -> "DeferredBatchNorm":
    new = cls(module.num_features, module.eps, module.momentum, module.affine)
    # The same tensors, not copies: training the converted layer updates the
    # original's weight, bias and running statistics.
    if module.affine:
        new.register_parameter("weight", module.weight)
        new.register_parameter("bias", module.bias)
    new.register_buffer("running_mean", module.running_mean)
    new.register_buffer("running_var", module.running_var)
    new.register_buffer("num_batches_tracked", module.num_batches_tracked)
    new.microbatches = microbatches
    new.train(module.training)
    return new


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object with the same attributes, whose own dicts, lists and sets
    (children, parameters, buffers, hooks) are copies: registering on it, or
    replacing a child, leaves ``module`` alone. The tensors and children are shared."""
    new = copy.copy(module)
    for key, value in vars(new).items():
        if isinstance(value, (dict, list, set)):
            vars(new)[key] = copy.copy(value)
    return new


def _convert(cls: type, module: nn.Module, microbatches: int, in_place: bool) -> nn.Module:
    # The public convert (in place) gives a DeferredBatchNorm for another count a new one
    # for this count, as torchgpipe's does; the Pipe's copy leaves it be (it calls begin()).
    deferred = isinstance(module, DeferredBatchNorm)
    if isinstance(module, _BatchNorm) and module.track_running_stats and \
            (not deferred or (in_place and module.microbatches != microbatches)):
        return _converted_batch_norm(cls, module, microbatches)
    converted = {name: _convert(cls, child, microbatches, in_place)
                 for name, child in module.named_children()}
    changed = {name: c for name, c in converted.items() if c is not module._modules[name]}
    if not changed:
        return module
    owner = module if in_place else _shallow_copy(module)
    for name, child in changed.items():
        setattr(owner, name, child)
    return owner


def _deferred_copy(module: nn.Module, microbatches: int = 1) -> nn.Module:
    """``module`` with its BatchNorms deferred, leaving ``module`` itself unchanged: a
    BatchNorm becomes a new DeferredBatchNorm sharing its parameters and buffers, a
    container holding one becomes a shallow copy holding the converted child; every
    other module is returned as it is (the same object)."""
    return _convert(DeferredBatchNorm, module, microbatches, in_place=False)


def convert_deferred_batch_norm(module: nn.Module, microbatches: int = 1) -> nn.Module:
    """Replaces every BatchNorm in ``module`` by a :class:`DeferredBatchNorm`, in place."""
    return DeferredBatchNorm.convert(module, microbatches)
