"""The pipeline over processes: one rank per stage (or per v stages) of an nn.Sequential, over torch.distributed."""
import atexit
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gpipe import _C
from gpipe.pipe import (BatchDim, _as_int, _batch_dims, _check_balance, _check_input,
                        _engine_checkpoint, _parse_balance, _parse_checkpoint, _parse_chunks,
                        _engine_schedule, _parse_schedule, _schedule_stages, _stage_workers,
                        _v_shaped)
from gpipe.pipeline import _Cut, _Pipelined, _cut
from gpipe._pipeline_split import balanced_split_points
from gpipe.schedule import Schedule
from gpipe.skip.layout import stage_runners
from gpipe.skip.skippable import verify_skippables

__all__ = ["Pipe", "clip_grad_norm_", "get_state_dict", "grad_scaler", "pipeline",
           "set_state_dict"]

TensorOrTensors = Union[Tensor, Tuple[Tensor, ...]]


def _default_device(group: Any) -> torch.device:
    # NCCL moves device memory: the stages run on this rank's current GPU
    # (torchrun: set it with torch.cuda.set_device(local_rank)). Gloo: CPU.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reverse_group(group: Any) -> Any:
    # NCCL runs a pair's sends and receives on one in-order queue: hand-offs
    # to a lower rank (grads) go over a second group of the same ranks, so
    # that a receive posted early never holds up a send the other way.
    # Gloo matches by tag and needs none.
    if dist.get_backend(group) != "nccl" or dist.get_world_size(group) == 1:
        return None
    return dist.new_group(dist.get_process_group_ranks(group), backend="nccl",
                          use_local_synchronization=True)


# The pipes of this process, closed at exit (_close_at_exit).
_pipes: "weakref.WeakSet[Pipe]" = weakref.WeakSet()
_close_registered = False


def _close_at_exit() -> None:
    """Ends the distributed work at a normal exit, while threads can still take the GIL.

    A Gloo worker thread destroys a finished work (an all_reduce's, or a
    barrier's that holds the works before it) after the caller's wait has
    returned, and letting go of a tensor that also has a Python object takes
    the GIL. If the main thread keeps the GIL until the interpreter begins
    finalizing, CPython ends the waiting worker with pthread_exit, whose
    unwinding through the work's noexcept destructor calls std::terminate:
    "terminate called without an active exception" (SIGABRT) after the
    script's last line, on one 4-rank launch in 6 to 8 here, with or without
    gpipe (pytorch/pytorch#190489). Destroying a Gloo group joins its
    workers, but only when nothing else holds the group. A pipe does, and so
    does torch itself (_forget_default_arguments): so the pipes let go first
    (their own threads are joined too), then torch's hold, then the default
    group goes if the script did not destroy it. atexit runs before
    finalization begins. After an uncaught exception nothing is touched
    (another rank may still be in a collective with this one).
    """
    if hasattr(sys, "last_value"):
        return
    for pipe in list(_pipes):
        pipe._close()
    _forget_default_arguments()
    if (dist.is_available() and dist.is_initialized()
            and dist.get_backend() == "gloo"):
        dist.destroy_process_group()


def _forget_default_arguments() -> None:
    """Lets go of the default group that torch.distributed.nn.functional holds.

    That module's functions take ``group=group.WORLD`` as a default argument,
    evaluated when the module is imported. torch._dynamo imports it, and so
    does building any optimizer: imported after init_process_group, ten
    functions hold the default group for good, destroy_process_group cannot
    free it, and its Gloo threads outlive the interpreter (measured: two
    worker threads left after destroy_process_group in a script that built
    an SGD optimizer, none without it). Imported before init, those defaults
    are None, which the functions read as the default group: they become
    None here too.
    """
    module = sys.modules.get("torch.distributed.nn.functional")
    if module is None:
        return
    for function in vars(module).values():
        defaults = getattr(function, "__defaults__", None)
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            function.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d
                                          for d in defaults)


class _Closed:
    """Stands for a pipe's engine after _close_at_exit."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("gpipe.distributed.Pipe was closed at interpreter exit (its threads "
                           "joined, its process groups released); build a new pipe")


def _find_ties(module: nn.Sequential, rank_of_layer: List[int]
                ) -> List[Tuple[List[str], List[int], Tensor]]:
    """The parameters that layers on two or more ranks share (tied weights), found by
    identity in the whole model every rank builds: (uses, owner ranks, parameter), in the
    order of their first use."""
    uses: Dict[int, Tuple[List[str], List[int], Tensor]] = {}
    for (name, layer), rank in zip(module.named_children(), rank_of_layer):
        for sub, p in layer.named_parameters(remove_duplicate=False):
            names, ranks, _ = uses.setdefault(id(p), ([], [], p))
            if f"{name}.{sub}" not in names:
                names.append(f"{name}.{sub}")
            if rank not in ranks:
                ranks.append(rank)
    return [(names, sorted(ranks), p) for names, ranks, p in uses.values() if len(ranks) > 1]


def _layer_settings(module: nn.Sequential) -> List[Tuple[str, str]]:
    """Each layer's parameters (names, shapes, dtypes), for the ranks to compare; not its
    class: a rank may wrap a layer (to inject a fault, say) with the same parameters."""
    settings = []
    for k, layer in enumerate(module):
        params = [f"{n} {list(p.shape)} {str(p.dtype).replace('torch.', '')}"
                  + ("" if p.requires_grad else " frozen")
                  for n, p in layer.named_parameters(remove_duplicate=False)]
        settings.append((f"layer {k}", ", ".join(params) or "none"))
    return settings


class Pipe(nn.Module):
    """Runs an ``nn.Sequential`` as a pipeline whose stages live on the ranks of a process group.

    Every rank builds the same model (or at least the same ``nn.Sequential``
    structure) and wraps it; rank r of ``group`` keeps the layers of the
    stages it owns and drops the rest. With R ranks and ``virtual_stages``
    v, ``balance`` has K = R * v entries (layers per stage) and stage s runs
    on rank s mod R (under 'zb_v', in a V: rank r runs stages r and 2R-1-r, so
    the first and the last stage share rank 0). ``parameters()`` and ``state_dict()`` hold this rank's
    layers only, under the Sequential's names ("4.weight"), so the union of
    all ranks' state dicts is the Sequential's.

    A step runs the same schedules as :meth:`gpipe.Pipe.train_step`
    ('gpipe', '1f1b', 'interleaved_1f1b', 'zb_h1', 'zb_v') through the same
    executor; activations and grads travel between ranks by c10d
    isend/irecv with a small header (shapes, dtypes, grad flags), so shapes
    may change from step to step.

    Args:
        module: the ``nn.Sequential`` to split.
        balance: layers per stage, R * virtual_stages entries.
        chunks: micro-batches per mini-batch; a batch must have at least
            ``chunks`` rows (every rank plans ``chunks`` micro-batches).
        schedule: 'gpipe', '1f1b' (default), 'interleaved_1f1b', 'zb_h1' or 'zb_v' (two
            stages per rank in a V), or a :class:`gpipe.Schedule` (a CSV table, one row
            per rank).
        checkpoint: 'always', 'except_last' (default) or 'never', or a list of one mode
            per stage (all ranks' stages).
        virtual_stages: stages per rank (interleaved_1f1b; 2 under zb_v, implied),
            default 1.
        group: the pipeline's process group (default: the world).
        mesh: instead of ``group``, a DeviceMesh with a dimension named "pp":
            the pipeline runs over it, and its other dimensions are free for
            FSDP2's ``fully_shard`` or tensor parallelism inside the stages
            (docs/distributed.md, With FSDP2 and Tensor parallel).
        dp_group: the group of this rank's data-parallel replicas (same
            stages on every member); each stage's grads are averaged over it
            as soon as they are final, in buckets, overlapped with the rest
            of the step's backward (docs/distributed.md). None: no data
            parallelism.
        bucket_cap_mb: with ``dp_group``, the most MiB of grads averaged in
            one all_reduce (default 25; a parameter is never split).
        device: where this rank's stages run (default: this rank's current
            GPU over NCCL, else CPU). Over Gloo, CUDA tensors travel through
            the host. Over NCCL the pipe makes a second group of the same
            ranks for hand-offs to lower ranks (every rank of ``group``
            builds its pipe, so they make it together).
        batch_dim: where the batch dimension lies in each input value, as in
            :class:`gpipe.Pipe` (an int for every value, or one entry per
            value, None for a value every micro-batch gets whole, such as
            position ids). The target is cut along dim 0.
        output_batch_dim: where :meth:`eval_step` joins the outputs, as in
            :class:`gpipe.Pipe`.
        step_timeout: seconds (or a ``timedelta``) this rank may wait for
            another within a step: for a hand-off, for the exchange that
            starts each step, for its sends to be taken. A wait that runs
            out fails the step, naming what this rank waited for (the stage,
            micro-batch and schedule action, as ``2F3``) and the rank that
            owes it; the ranks waiting for this one then fail too, each
            naming its own wait. None (default): the process group's own
            timeout (30 minutes by default) bounds each wait.

    At construction the ranks compare their settings (balance, chunks,
    schedule, virtual stages, checkpoint, batch dims) and every layer's
    parameter names, shapes and dtypes, with one small exchange
    over ``group``; where any rank differs, every rank raises a ValueError
    naming each setting and each rank's value.

    Tied weights: a Parameter that layers on several ranks share (a GPT's
    token embedding and its lm_head, ``head.weight = emb.weight``) is found
    by identity, as Megatron-LM ties its embeddings: each rank holding a use
    (an owner) keeps a replica, the replicas start as the lowest owner's,
    and after every :meth:`train_step` each replica's ``.grad`` is the sum
    of every use's grad (the plain model's grad), summed over a group of the
    owners that the pipe makes (``new_group``, once). Any deterministic
    optimizer then keeps the replicas equal. With ``dp_group`` the sum runs
    after the data-parallel averaging (both are sums: the same result).

    At a normal exit (an atexit hook, before the interpreter finalizes)
    every pipe joins its threads and lets go of its process groups, and a
    Gloo default group still initialized is destroyed: Gloo's threads must
    be gone before finalization, or one may abort the process
    (docs/distributed.md, Limits). After an uncaught exception nothing is
    touched. Still end every rank with ``dist.destroy_process_group()``.

    Attributes:
        rank: this rank's index in ``group``.
        stages: the global indices of the stages this rank owns.
        is_first: whether this rank owns stage 0 (it takes the input).
        is_last: whether this rank owns the last stage (it takes the target
            and gets the loss and outputs).
        tied_parameters: the Parameters shared across ranks, as (uses,
            owner ranks), e.g. ``[(['0.tok.weight', '7.out.weight'], [0, 3])]``.

    Example::

        dist.init_process_group()          # torchrun's environment
        pipe = gpipe.distributed.Pipe(model, balance=[2, 2, 2, 2], chunks=8)
        loss = pipe.train_step(x if pipe.is_first else None,
                               target=y if pipe.is_last else None,
                               loss_fn=nn.functional.mse_loss)
    """

    def __init__(self, module: nn.Sequential, balance: Any, *, chunks: int = 1,
                 schedule: str = "1f1b", checkpoint: Any = "except_last",
                 virtual_stages: int = 1, group: Optional[Any] = None,
                 dp_group: Optional[Any] = None, device: Optional[Any] = None,
                 bucket_cap_mb: float = 25, batch_dim: BatchDim = 0,
                 output_batch_dim: Optional[BatchDim] = None, mesh: Optional[Any] = None,
                 step_timeout: Optional[Any] = None) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("gpipe.distributed.Pipe needs an initialised process group; call "
                               "torch.distributed.init_process_group() first (torchrun sets "
                               "its environment), or use gpipe.Pipe within one process")
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"module must be nn.Sequential to be partitioned, got "
                            f"{type(module).__name__}")
        input_dims = _batch_dims(batch_dim, "batch_dim")
        output_dims = ([] if output_batch_dim is None
                       else _batch_dims(output_batch_dim, "output_batch_dim"))
        self.batch_dim = batch_dim
        self.output_batch_dim = output_batch_dim
        self.chunks = _parse_chunks(chunks)
        self.schedule = _parse_schedule(schedule)
        self.checkpoint = _parse_checkpoint(checkpoint)
        self.virtual_stages = _as_int(virtual_stages, "virtual_stages",
                                      "pass the number of stages per rank, e.g. 2")
        if self.virtual_stages < 1:
            raise ValueError(f"virtual_stages must be at least 1, got {self.virtual_stages}")
        self.virtual_stages = _schedule_stages(self.schedule, self.virtual_stages, "rank")
        if mesh is not None:
            if group is not None:
                raise ValueError("pass the pipeline's ranks as group= or as mesh= (a DeviceMesh "
                                 "with a 'pp' dimension), not both")
            group = _pp_group(mesh)
        self.group = group if group is not None else dist.group.WORLD
        self.dp_group = dp_group
        if (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
                or not bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got "
                             f"{bucket_cap_mb!r}; the default is 25")
        self.bucket_cap_mb = bucket_cap_mb
        ranks = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        balance = _parse_balance(balance)
        stages = ranks * self.virtual_stages
        if len(balance) != stages:
            where = ("rank r runs stages r and 2R-1-r" if _v_shaped(self.schedule)
                     else f"stage s runs on rank s % {ranks}")
            raise ValueError(
                f"balance has {len(balance)} stages but the group has {ranks} ranks x "
                f"virtual_stages {self.virtual_stages} = {stages} stages; pass {stages} entries "
                f"(layers per stage; {where})")
        _check_balance(module, balance)
        verify_skippables(module)
        self.balance = balance
        self.device = torch.device(device) if device is not None else _default_device(self.group)
        rank_of_stage = _stage_workers(self.schedule, ranks, stages)
        self.stages: List[int] = [s for s in range(stages) if rank_of_stage[s] == self.rank]
        self.is_first = 0 in self.stages
        self.is_last = stages - 1 in self.stages

        # Keep this rank's layers under their names in the Sequential.
        starts = [sum(balance[:s]) for s in range(stages)]
        names = list(module._modules.keys())
        layers = list(module)
        parts: List[Any] = []
        for s in self.stages:
            part = []
            for k in range(starts[s], starts[s] + balance[s]):
                layer = layers[k].to(self.device)
                self.add_module(names[k], layer)
                part.append(layer)
            parts.append(part)
        self._reverse_group = _reverse_group(self.group)
        # Skips across stages travel between ranks like activations: every
        # rank sees the whole model's routes; its runners take and give those
        # of its stages.
        parts, routes = stage_runners(
            [layers[starts[s]:starts[s] + balance[s]] for s in range(stages)], parts, self.stages)
        self._engine = _C.Engine(parts, [self.device] * len(parts), self.chunks,
                                 _engine_checkpoint(self.checkpoint),
                                 intra_op_threads=-1, virtual_stages=self.virtual_stages,
                                 schedule=_engine_schedule(self.schedule),
                                 skip_routes=routes,
                                 group=self.group.group_name,
                                 reverse_group=(self._reverse_group.group_name
                                                if self._reverse_group is not None else ""),
                                 dp_group=dp_group.group_name if dp_group is not None else "")
        self._engine.set_bucket_cap(max(1, int(bucket_cap_mb * 2**20)))
        self.step_timeout = step_timeout
        self._engine.set_batch_dims(input_dims, output_dims)

        # What every rank must share, compared before anything else travels;
        # then the parameters tied across ranks.
        rank_of_layer = [rank_of_stage[s] for s in range(stages) for _ in range(balance[s])]
        ties = _find_ties(module, rank_of_layer)
        settings = [("balance", str(balance)), ("chunks", str(self.chunks)),
                    ("schedule", (self.schedule.csv.replace("\n", "; ")
                                  if isinstance(self.schedule, Schedule) else self.schedule)),
                    ("virtual_stages", str(self.virtual_stages)),
                    ("checkpoint", str(self.checkpoint)), ("batch_dim", str(input_dims)),
                    ("output_batch_dim", str(output_dims)),
                    ("tied parameters", "; ".join(" = ".join(uses) for uses, _, _ in ties)
                     or "none")]
        self._engine.check_agreement(settings + _layer_settings(module),
                                     "gpipe.distributed.Pipe")
        if isinstance(self.schedule, Schedule):
            # After the ranks agreed on it: it fits on every rank or on none.
            self._engine.set_plan_csv(self.schedule.csv)
        if isinstance(self.checkpoint, list):
            self._engine.set_stage_checkpoints(self.checkpoint)
        self._tie_groups: Dict[Tuple[int, ...], Any] = {}
        entries = []
        for uses, owners, param in ties:
            here = self.rank in owners
            name = ""
            if here:
                key = tuple(owners)
                if key not in self._tie_groups:
                    # Only the owners take part (every owner makes its ties' groups in
                    # the same order).
                    self._tie_groups[key] = dist.new_group(
                        [dist.get_global_rank(self.group, r) for r in owners],
                        backend=dist.get_backend(self.group), use_local_synchronization=True)
                name = self._tie_groups[key].group_name
            entries.append((uses, owners, param, here, name))
        self._engine.set_ties(entries)
        self.tied_parameters = [(uses, owners) for uses, owners, _ in ties]
        # This rank's uses of them (tie, name), as the tie exchange holds them (_check_ties).
        self._tied_here: List[Tuple[int, str, Tensor]] = []
        for k, (uses, owners, param) in enumerate(ties):
            for name in uses:
                if rank_of_layer[names.index(name.split(".", 1)[0])] == self.rank:
                    self._tied_here.append((k, name, param))
        self._tie_count = len(ties)
        global _close_registered
        _pipes.add(self)
        if not _close_registered:
            atexit.register(_close_at_exit)
            _close_registered = True

    @property
    def step_timeout(self) -> Optional[float]:
        """Seconds this rank may wait for another within a step (None: the
        process group's own timeout); settable between steps."""
        return self._step_timeout

    @step_timeout.setter
    def step_timeout(self, value: Optional[Any]) -> None:
        from datetime import timedelta
        if value is None:
            seconds = None
        elif isinstance(value, timedelta):
            seconds = value.total_seconds()
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            seconds = float(value)
        else:
            raise TypeError(f"step_timeout must be seconds (a number), a datetime.timedelta or "
                            f"None, got {value!r}")
        if seconds is not None and not seconds > 0:
            raise ValueError(f"step_timeout must be positive, got {value!r}; pass None for the "
                             f"process group's own timeout")
        self._engine.set_step_timeout(0.0 if seconds is None else seconds)
        self._step_timeout = seconds

    def _close(self) -> None:
        """Joins this pipe's threads and drops its process groups (see _close_at_exit)."""
        self._engine = _Closed()
        self.group = self.dp_group = self._reverse_group = None
        self._tie_groups = {}

    def schedule_csv(self) -> str:
        """The order :meth:`train_step` runs on every rank, for ``chunks`` micro-batches, as a
        table in torch.distributed.pipelining's CSV format (one row per rank); see
        :class:`gpipe.Schedule`."""
        return self._engine.plan_csv(self.chunks)

    def _check_step(self, input: Optional[TensorOrTensors], what: str) -> None:
        if self.is_first:
            if input is None:
                raise ValueError(f"rank {self.rank} holds stage 0, so {what} needs the input "
                                 f"here: pass {what}(x if pipe.is_first else None, ...)")
            _check_input(input)

    def _check_ties(self, units: List[nn.Module]) -> Dict[int, Any]:
        """Where this rank's tied parameters will collect the step's grads, checked before
        the step: a use still holding the Parameter found at construction needs nothing; one
        that FSDP2 (fully_shard or its replicate) swapped for its shards collects them on the
        unit's unsharded copy, which the step must sum instead (returned as {tie: FSDPParam},
        see _fsdp_tie_replicas). Anything else (an assignment, tensor parallelism) is refused."""
        if not self._tied_here:
            return {}
        sharded = {}
        for unit in units:
            group = unit._get_fsdp_state()._fsdp_param_group
            for fsdp_param in (group.fsdp_params if group is not None else []):
                sharded[id(fsdp_param.sharded_param)] = fsdp_param
        holder: Dict[int, Any] = {}
        managed: Dict[int, Any] = {}
        for k, name, param in self._tied_here:
            current = self.get_parameter(name)
            fsdp_param = None if current is param else sharded.get(id(current))
            if current is not param and (fsdp_param is None or fsdp_param.is_dtensor):
                raise RuntimeError(
                    f"the parameter {name!r}, tied across ranks, was replaced after the pipe was "
                    f"built (by an assignment, or tensor parallelism): the pipe sums the grads of "
                    f"the Parameter it found at construction, so this one's would be wrong. "
                    f"Leave the tied layers as they were built (FSDP2's fully_shard and "
                    f"replicate are fine), or untie the weight")
            if holder.setdefault(k, current) is not current:
                raise RuntimeError(
                    f"the uses of the parameter {name!r}, tied across ranks, on rank "
                    f"{self.rank} no longer share one Parameter (one of them was sharded or "
                    f"replaced apart from the others): put the layers that use it here in one "
                    f"FSDP2 unit, or none")
            if fsdp_param is not None:
                managed[k] = fsdp_param
        return managed

    def _fsdp_tie_replicas(self, managed: Dict[int, Any], units: List[nn.Module]) -> None:
        """Points the tie exchange at the unsharded copies of the tied parameters FSDP2
        manages (after _fsdp_begin): their units gather now, not in their first forward (still
        once per step), so that the copies exist; the step's grads of a tie are summed over its
        owners on those copies, before FSDP2 reduce-scatters them at the step's end."""
        if not managed:
            return
        for unit in units:
            state = unit._get_fsdp_state()
            group = state._fsdp_param_group
            if group is None or not any(p in group.fsdp_params for p in managed.values()):
                continue
            if state._is_root is None:
                state._lazy_init()
            unit.unshard()
        replicas: List[Optional[Tensor]] = [None] * self._tie_count
        for k, fsdp_param in managed.items():
            replicas[k] = fsdp_param.unsharded_param
        self._engine.set_tie_replicas(replicas)

    def train_step(self, input: Optional[TensorOrTensors] = None,
                   target: Optional[TensorOrTensors] = None, *,
                   loss_fn: Callable[[TensorOrTensors, TensorOrTensors], Tensor]
                   ) -> Optional[Tensor]:
        """One training step over every rank: forward, ``loss_fn(output,
        target)`` per micro-batch on the last stage (scaled by its share of
        the rows) and backward, in the schedule's order, as
        :meth:`gpipe.Pipe.train_step`. Every rank of the group calls it;
        ``input`` matters only on the first rank, ``target`` only on the last
        (pass None elsewhere). Returns the batch's mean loss (detached) on
        the last rank, None on the others. Grads accumulate into this rank's
        parameters' ``.grad``; with ``dp_group`` they are averaged over the
        replicas within the step (a stage's as soon as its last backward
        ran), so that R replicas equal one on their concatenated batches.
        A grad undefined here stays undefined (the replicas run the same
        model, so they agree on which are).

        Bad arguments on any rank (a missing input or target, a value that
        is not a tensor, ``loss_fn`` not callable, too few rows for
        ``chunks``, a target cut unlike the input) are found before anything
        is sent: the ranks exchange their checks' outcome and the input's
        and target's rows (one small all_reduce per step), every rank raises
        (that rank its own error, the others a ValueError naming it) and the
        pipe works on at the next step. A failure during the step (a layer
        or ``loss_fn`` raising, a loss that is not one number, a lost rank)
        fails the step on every rank, each naming the rank where it started;
        the pipe then refuses further steps (the group's point-to-point
        state is undefined after it): recreate the process group and the
        pipe.
        """
        units = _fsdp_units(self)
        try:
            if not callable(loss_fn):
                raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got "
                                f"{loss_fn!r}")
            self._check_step(input, "train_step")
            managed = self._check_ties(units)
            if self.is_last:
                if target is None:
                    raise ValueError(f"rank {self.rank} holds the last stage, so train_step "
                                     f"needs the target here: pass target=y if pipe.is_last "
                                     f"else None")
                _check_input(target, "target")
        except Exception as e:
            # The other ranks are in the step already: they fail too, naming this rank.
            self._engine.abandon_step(f"{type(e).__name__}: {e}", True)
            raise
        _fsdp_begin(self, units, training=True)
        try:
            self._fsdp_tie_replicas(managed, units)
        except Exception as e:
            _fsdp_end(units, reduce=False)
            self._engine.abandon_step(f"{type(e).__name__}: {e}", True)
            raise
        try:
            loss = self._engine.train_step(input if self.is_first else None,
                                           target if self.is_last else None, loss_fn,
                                           self.training)
        except BaseException:
            _fsdp_end(units, reduce=False)
            raise
        _fsdp_end(units, reduce=True)
        return loss if self.is_last else None

    @torch.no_grad()
    def eval_step(self, input: Optional[TensorOrTensors] = None) -> Optional[TensorOrTensors]:
        """Pipelined inference: ``input`` (first rank only) through every
        stage, micro-batch by micro-batch, without grads or checkpoints.
        Returns the gathered output on the last rank, None elsewhere."""
        try:
            self._check_step(input, "eval_step")
        except Exception as e:
            self._engine.abandon_step(f"{type(e).__name__}: {e}", False)
            raise
        units = _fsdp_units(self)
        _fsdp_begin(self, units, training=False)
        try:
            out = self._engine.eval_step(input if self.is_first else None)
        finally:
            _fsdp_end(units, reduce=False)
        return out if self.is_last else None

    @property
    def tracing(self) -> bool:
        """Whether this rank records its cells and its hand-offs with other
        ranks (``send`` and ``receive`` events, naming the stage at the
        other end in ``peer``); see :attr:`trace`."""
        return self._engine.tracing

    @tracing.setter
    def tracing(self, on: bool) -> None:
        self._engine.tracing = bool(on)

    @property
    def trace(self) -> "_C.Trace":
        """What this rank recorded while :attr:`tracing` was on, as
        :attr:`gpipe.Pipe.trace`; times count from :attr:`trace_origin_ns`."""
        return self._engine.trace()

    @property
    def trace_origin_ns(self) -> int:
        """Where this rank's trace times count from, on the host's steady
        clock (``time.monotonic_ns()``): ``trace_origin_ns / 1e3 +
        event.start_us`` puts the traces of all ranks of one machine on one
        timeline."""
        return self._engine.trace_origin_ns

    def clear_trace(self) -> None:
        """Forgets what was recorded."""
        self._engine.clear_trace()

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Refused: a pipeline over ranks runs whole steps on every rank
        (:meth:`train_step`, :meth:`eval_step`)."""
        raise RuntimeError("gpipe.distributed.Pipe runs whole steps over all ranks: call "
                           "train_step(...) or eval_step(...) on every rank")

    def extra_repr(self) -> str:
        text = (f"rank={self.rank}, stages={self.stages}, balance={self.balance}, "
                f"chunks={self.chunks}, schedule={self.schedule!r}, "
                f"checkpoint={self.checkpoint!r}")
        if self.virtual_stages != 1:
            text += f", virtual_stages={self.virtual_stages}"
        return text


class _PipelinedPipe(_Pipelined, Pipe):
    """A :class:`Pipe` over the stages of a traced module (:func:`pipeline`): steps take
    the module's arguments and give what it returns; ``state_dict()`` keys are the module's
    (this rank's part of them)."""

    def __init__(self, cut: _Cut) -> None:
        Pipe.__init__(self, nn.Sequential(*cut.stages), [1] * len(cut.stages), **cut.options)
        self._pipelined(cut)

    def _local_stages(self) -> Optional[Set[int]]:
        return set(self.stages)

    def _packed(self, input: Any, kwargs: Optional[Dict[str, Any]], training: bool) -> Any:
        """The first rank's arguments as the pipe's inputs; a bad call fails the step on
        every rank (the others are in it already)."""
        if not self.is_first:
            return None
        try:
            if input is None and not kwargs:
                raise ValueError(f"rank {self.rank} holds the first stage, so the step needs "
                                 f"the module's arguments here: pass input=(x, ...) and "
                                 f"kwargs={{...}} if pipe.is_first else None")
            args = () if input is None else input if isinstance(input, tuple) else (input,)
            return self._inputs(args, kwargs or {})
        except Exception as e:
            self._engine.abandon_step(f"{type(e).__name__}: {e}", training)
            raise

    def train_step(self, input: Any = None, target: Optional[TensorOrTensors] = None, *,
                   loss_fn: Callable[[Any, Any], Tensor],
                   kwargs: Optional[Dict[str, Any]] = None) -> Optional[Tensor]:
        """:meth:`Pipe.train_step` with the module's arguments on the first rank: ``input``
        is its one positional tensor or a tuple of its positional arguments, ``kwargs`` its
        keyword arguments (None on the other ranks); ``loss_fn`` gets one micro-batch's
        output as the module returns it."""
        packed = self._packed(input, kwargs, True)
        return super().train_step(packed, target,
                                  loss_fn=lambda out, tgt: loss_fn(self._outputs(out), tgt))

    @torch.no_grad()
    def eval_step(self, input: Any = None,  # type: ignore[override]
                  kwargs: Optional[Dict[str, Any]] = None) -> Any:
        """:meth:`Pipe.eval_step` with the module's arguments on the first rank; returns
        what the module returns on the last rank, None elsewhere."""
        out = super().eval_step(self._packed(input, kwargs, False))
        return None if out is None else self._outputs(out)


def pipeline(module: nn.Module, split_points: Optional[Sequence[str]] = None,
             example_args: Any = (), example_kwargs: Optional[Dict[str, Any]] = None, *,
             stages: Optional[int] = None, balance_by: str = "params", tracer: str = "auto",
             **pipe_options: Any) -> Pipe:
    """:func:`gpipe.pipeline` over ranks: cuts ``module`` into stages at ``split_points``
    and returns a :class:`Pipe` whose stage s runs on rank s mod R (R the group's size; under
    ``schedule='zb_v'``, two stages per rank in a V).

    Every rank calls it with the same module (built the same way) and the same arguments;
    each traces the module (``tracer`` as in :func:`gpipe.pipeline`: by default torch.fx,
    and torch.export where fx cannot trace) and keeps its own stages. K split points give
    K + 1 stages, which must be R * ``virtual_stages``; with neither ``split_points`` nor
    ``stages``, the module is cut into that many stages, balanced by ``balance_by`` over
    the submodules its forward calls, down into its ModuleLists and Sequentials (a Hugging
    Face causal LM splits inside ``model.layers``; with ``"time"``, the split points the
    group's first rank profiled, sent to the others). ``pipe.split_points`` and
    ``pipe.tracer`` say what was chosen. ``pipe_options`` are
    :class:`Pipe`'s own (``chunks``, ``schedule``, ``group``, ``dp_group``, ``device``...),
    except ``balance``; ``batch_dim`` may name the forward's parameters as in
    :func:`gpipe.pipeline`.

    Steps take the module's arguments on the first rank and give what it returns on the
    last: ``pipe.train_step((idx,), target, loss_fn=..., kwargs={"attention_mask": m})``
    (``input``/``kwargs`` None on the other ranks, ``target`` None but on the last) and
    ``pipe.eval_step(...)`` likewise. ``state_dict()`` keys are the module's: each rank
    saves its stages' part and the union over ranks is ``module.state_dict()``; every rank
    may load the module's whole state_dict (a rank drops the keys only other ranks hold).
    A parameter used in stages on two ranks (a tied embedding and head) is tied across
    them as in :class:`Pipe`."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("gpipe.distributed.pipeline needs an initialised process group; call "
                           "torch.distributed.init_process_group() first (torchrun sets its "
                           "environment), or use gpipe.pipeline within one process")
    group = pipe_options.get("group")
    if group is None:
        group = dist.group.WORLD
    if pipe_options.get("mesh") is not None:
        group = _pp_group(pipe_options["mesh"])
    virtual = pipe_options.get("virtual_stages", 1)
    if pipe_options.get("schedule") == "zb_v" and virtual == 1:
        virtual = 2  # two stages per rank in a V, implied
    wanted = dist.get_world_size(group) * (virtual if isinstance(virtual, int) else 1)
    if split_points is None and stages is None:
        stages = wanted
    if split_points is None and balance_by == "time":
        # Timings differ from rank to rank: every rank takes the first rank's choice. (Every
        # rank profiles, so that a module failing to trace or run fails on every rank alike
        # instead of leaving the others in the broadcast.)
        chosen = [balanced_split_points(module, stages, balance_by, example_args,
                                        example_kwargs)]
        dist.broadcast_object_list(chosen, src=dist.get_global_rank(group, 0), group=group)
        split_points, stages = chosen[0], None
    cut = _cut(module, split_points, example_args, example_kwargs, stages, balance_by, tracer,
               pipe_options, Pipe, "gpipe.distributed.pipeline")
    # (A Schedule table sets the stages per rank itself; Pipe checks the count then.)
    if (len(cut.stages) != wanted and isinstance(virtual, int)
            and not isinstance(pipe_options.get("schedule"), Schedule)):
        raise ValueError(f"the split points give {len(cut.stages)} stages but the pipeline has "
                         f"{wanted // virtual} ranks x virtual_stages {virtual} = {wanted} "
                         f"stages; pass {wanted - 1} split points, or stages={wanted}")
    return _PipelinedPipe(cut)


def _pp_group(mesh: Any) -> Any:
    """The process group of a DeviceMesh's "pp" dimension."""
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None or not hasattr(mesh, "get_group"):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh with named "
                        f"dimensions, got {type(mesh).__name__}; build it with "
                        f"init_device_mesh(..., mesh_dim_names=('pp', ...))")
    if "pp" not in names:
        raise ValueError(f"mesh has dimensions {list(names)}, none named 'pp': name the "
                         f"pipeline's dimension 'pp' (init_device_mesh(..., mesh_dim_names="
                         f"('pp', 'dp')))")
    return mesh.get_group("pp")


def _fsdp_units(pipe: Pipe) -> List[nn.Module]:
    """The pipe's modules that FSDP2's fully_shard made units, outermost first (the pipe itself
    when it is one)."""
    # Not imported: nothing can be a unit (and importing it would cost most of a second).
    fsdp = sys.modules.get("torch.distributed.fsdp")
    unit = getattr(fsdp, "FSDPModule", None)
    if unit is None:
        return []
    return [m for m in pipe.modules() if isinstance(m, unit)]


def _shards(unit: nn.Module) -> bool:
    """Whether an FSDP2 unit shards its parameters (fully_shard, HSDP), rather than keeping
    them whole on every replica (FSDP2's replicate, whose units refuse
    set_reshard_after_forward; they still free their unsharded copy after a backward unless
    told not to)."""
    group = unit._get_fsdp_state()._fsdp_param_group
    return group is not None and hasattr(group.mesh_info, "shard_mesh_dim") and \
        group.mesh_info.shard_mesh_dim is not None


def _fsdp_begin(pipe: Pipe, units: List[nn.Module], training: bool) -> None:
    """Before a step: FSDP2 units gather their parameters once per step, not per micro-batch.

    FSDP2 is written for one forward and one backward per step. Under a pipeline, every unit
    runs once per micro-batch. Its hooks would then all-gather in each forward and each
    backward, and reduce-scatter after each backward. So, as torch.distributed.pipelining's
    stage does:
    - no resharding after a forward or a backward, and no gradient sync, until the step ends
      (_fsdp_end): each unit all-gathers in its first forward and keeps its parameters whole;
      grads accumulate unsharded over the micro-batches;
    - a unit on the pipe itself (``fully_shard(pipe)``, one unit for this rank's stages)
      gathers here, before the first cell: the pipe's own forward, where FSDP would do it,
      never runs. This uses FSDP2's root initialization (_lazy_init), which its pre-forward
      hook runs.
    Collectives of one dp group come in the same order on every replica: the replicas run
    the same plan, a stage's units gather in its first forward, in layer order, and a later
    stage's first forward waits for an earlier one's output.
    """
    if not units:
        return
    for unit in units:
        if _shards(unit):
            unit.set_reshard_after_forward(False, recurse=False)
        if training:
            unit.set_is_last_backward(False)
            unit.set_reshard_after_backward(False, recurse=False)
            unit.set_requires_gradient_sync(False, recurse=False)
    if units[0] is pipe:
        pipe._get_fsdp_state()._lazy_init()
        pipe.unshard()


def _fsdp_end(units: List[nn.Module], reduce: bool) -> None:
    """After a step: each unit's accumulated grads reduce-scattered once (``reduce``; FSDP2's
    post-backward, run by hand as torch.distributed.pipelining's stage does), then every unit
    resharded: between steps a rank keeps its shards only."""
    if not units:
        return
    for unit in units:
        unit.set_is_last_backward(True)
        unit.set_reshard_after_backward(True, recurse=False)
        unit.set_requires_gradient_sync(True, recurse=False)
    if reduce:
        finished = set()
        for unit in units:
            state = unit._get_fsdp_state()
            context = state._state_ctx
            if id(context) in finished:
                continue
            finished.add(id(context))
            for member in context.all_states:
                if member._fsdp_param_group is not None:
                    member._fsdp_param_group.post_backward()
            state._root_post_backward_final_callback()
    for unit in units:
        unit.reshard()


def _counted_here(pipe: Pipe) -> Callable[[Tensor], bool]:
    """Whether this rank counts a parameter in the whole model's norm: a parameter tied
    across ranks has a replica on each owner, each holding the whole grad, and only the
    lowest owner counts it."""
    elsewhere = set()
    for uses, owners in pipe.tied_parameters:
        if pipe.rank in owners and owners[0] != pipe.rank:
            for name in uses:
                try:
                    elsewhere.add(id(pipe.get_parameter(name)))
                except AttributeError:  # a use on another rank
                    pass
    return lambda p: id(p) not in elsewhere


def clip_grad_norm_(pipe: Pipe, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for the whole pipelined model.

    Every rank of ``pipe.group`` calls it after :meth:`Pipe.train_step`.
    Returns the norm of all the model's grads, as the plain model's
    ``clip_grad_norm_`` computes it, on every rank alike. Each rank then
    scales its own grads by ``max_norm / (norm + 1e-6)`` when that is below
    1, as torch does.

    What counts once:
    - a parameter tied across ranks: every owner holds a replica with the
      whole grad, and the lowest owner counts it;
    - the replicas of ``dp_group`` (their grads are averaged within the
      step, so they hold the same grads).

    A grad that is a DTensor (``fully_shard`` or tensor parallelism over
    other mesh dimensions) counts with its whole value: torch's norm of
    DTensors, then ``full_tensor()``.

    One all_reduce per call runs over ``pipe.group`` (a sum of
    ``norm ** norm_type``, or a max for ``inf``), so every rank of the
    group must call it. ``error_if_nonfinite`` raises on every rank alike,
    since every rank sees the same norm.
    """
    if not isinstance(pipe, Pipe):
        raise TypeError(f"gpipe.distributed.clip_grad_norm_ takes a gpipe.distributed.Pipe, got "
                        f"{type(pipe).__name__}; for a model in one process use "
                        f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)")
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive (2.0, 1.0, inf...), got {norm_type}")
    params = [p for p in pipe.parameters() if p.grad is not None]
    counted = _counted_here(pipe)
    grads = [p.grad for p in params if counted(p)]
    local = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
    full_tensor = getattr(local, "full_tensor", None)
    if full_tensor is not None:  # a DTensor: the norm over its mesh
        local = full_tensor()
    local = local.to(device=pipe.device, dtype=torch.float64)
    if norm_type == float("inf"):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=pipe.group)
        total = local
    else:
        local = local.pow(norm_type)
        dist.all_reduce(local, group=pipe.group)
        total = local.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the pipe's gradients is non-finite "
            f"({total.item()}), so they cannot be clipped; pass error_if_nonfinite=False to "
            f"clip anyway")
    dtype = grads[0].dtype if grads else torch.get_default_dtype()
    total = total.to(dtype)
    plain = [p for p in params if not hasattr(p.grad, "full_tensor")]
    if plain:
        torch.nn.utils.clip_grads_with_norm_(plain, max_norm, total, foreach)
    if len(plain) < len(params):
        # A DTensor grad takes the factor as a number (the norm is a plain tensor).
        coef = min(1.0, float(max_norm) / (total.item() + 1e-6))
        for p in params:
            if hasattr(p.grad, "full_tensor"):
                p.grad.mul_(coef)
    return total


def _pipeline_options(options: Any) -> Any:
    from dataclasses import replace

    from torch.distributed.checkpoint.state_dict import StateDictOptions
    if options is None:
        return StateDictOptions(flatten_optimizer_state_dict=True)
    if not isinstance(options, StateDictOptions):
        raise TypeError(f"options must be a torch.distributed.checkpoint.state_dict."
                        f"StateDictOptions, got {type(options).__name__}")
    return replace(options, flatten_optimizer_state_dict=True)


def get_state_dict(model: nn.Module, optimizers: Any, *, submodules: Any = None,
                   options: Any = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``torch.distributed.checkpoint.state_dict.get_state_dict`` for a pipe, with the
    optimizer's state flattened: ``(model_state_dict, optimizer_state_dict)``, both keyed by
    the Sequential's parameter names, for ``torch.distributed.checkpoint.save``.

    Every rank of a pipeline holds other parameters. Torch's default optimizer state dict
    keeps ``param_groups`` as one list, and DCP saves such a value from one rank only: a load
    on another layout then misses the other ranks' groups (``KeyError: 'betas'``). Flattened
    (``StateDictOptions(flatten_optimizer_state_dict=True)``, which this sets on ``options``),
    every parameter's state and group settings travel under its own name. The result loads on
    any number of ranks and any balance, into an in-process :class:`gpipe.Pipe` and into the
    plain Sequential (:func:`set_state_dict`). ``model`` may be any of those; ``optimizers``,
    ``submodules`` and the other ``options`` are torch's.
    """
    from torch.distributed.checkpoint import state_dict as sd
    if not isinstance(model, _Pipelined):
        return sd.get_state_dict(model, optimizers, submodules=submodules,
                                 options=_pipeline_options(options))
    # A pipe from gpipe.pipeline: torch names parameters by named_parameters() ('2.ln_f.weight');
    # the dicts are renamed to the module's keys ('ln_f.weight'), so the checkpoint loads into
    # the module itself too.
    with model._stage_names():
        model_sd, optim_sd = sd.get_state_dict(model, optimizers, submodules=submodules,
                                               options=_pipeline_options(options))
    return ({model._module_key(k): v for k, v in model_sd.items()},
            {key: v for k, v in optim_sd.items()
             for key in _optim_keys(k, lambda fqn: [model._module_key(fqn)])})


def _optim_keys(key: str, rename: Callable[[str], List[str]]) -> List[str]:
    """A flattened optimizer key ('state.<fqn>.<field>', 'param_groups.<fqn>.<field>') with
    its parameter name renamed (to each of ``rename(fqn)``); the field is the last dotted
    part. Other keys stay as they are."""
    kind, _, rest = key.partition(".")
    fqn, _, field = rest.rpartition(".")
    if kind not in ("state", "param_groups") or not fqn:
        return [key]
    return [f"{kind}.{name}.{field}" for name in rename(fqn)]


def set_state_dict(model: nn.Module, optimizers: Any, *, model_state_dict: Dict[str, Any],
                   optim_state_dict: Dict[str, Any], options: Any = None) -> Any:
    """``torch.distributed.checkpoint.state_dict.set_state_dict`` for a pipe: loads what
    :func:`get_state_dict` gave (after ``torch.distributed.checkpoint.load`` filled it in),
    with the optimizer's state flattened likewise. Returns torch's missing and unexpected
    keys."""
    from torch.distributed.checkpoint import state_dict as sd
    if not isinstance(model, _Pipelined):
        return sd.set_state_dict(model, optimizers, model_state_dict=model_state_dict,
                                 optim_state_dict=optim_state_dict,
                                 options=_pipeline_options(options))
    # A pipe from gpipe.pipeline: the module's keys back to this rank's stages' names (a key
    # of a parameter two local stages use goes to both).
    model_sd = {stage_key: v for k, v in model_state_dict.items()
                for stage_key in model._stage_keys_of(k)}
    optim_sd = {key: v for k, v in optim_state_dict.items()
                for key in _optim_keys(k, model._stage_keys_of)}
    with model._stage_names():
        return sd.set_state_dict(model, optimizers, model_state_dict=model_sd,
                                 optim_state_dict=optim_sd, options=_pipeline_options(options))


def grad_scaler(pipe: Pipe, *, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                backoff_factor: float = 0.5, growth_interval: int = 2000,
                enabled: bool = True) -> Any:
    """A loss scaler for fp16 training of a pipe, alike on every rank of ``pipe.group``.

    It is torch's ``ShardedGradScaler`` over ``pipe.group``, with its scale made on every rank
    now. Only the last rank computes losses, so ``scale`` never runs elsewhere, and torch's
    scaler would refuse ``step`` there. Scale each micro-batch's loss in ``loss_fn``, then
    step as with torch's scaler::

        scaler = gpipe.distributed.grad_scaler(pipe)
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        loss_fn=lambda out, y: scaler.scale(F.cross_entropy(out, y)))
        scaler.step(opt)          # unscales; skipped on every rank if any found inf or nan
        scaler.update()

    ``unscale_`` (inside ``step``, or called first to clip with :func:`clip_grad_norm_`)
    sums every rank's found-inf flag over ``pipe.group``, so one rank's inf skips the step
    and lowers the scale on every rank. Within one pipeline that is all it takes: the
    ``dp_group`` average, FSDP2's reduce-scatter and the tie exchange all spread an inf to
    every replica they sum over. Arguments as ``torch.amp.GradScaler``'s.
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    scaler = ShardedGradScaler(device=pipe.device.type, init_scale=init_scale,
                               growth_factor=growth_factor, backoff_factor=backoff_factor,
                               growth_interval=growth_interval, enabled=enabled,
                               process_group=pipe.group)
    # Makes the scale on this rank's device (the public way: scaling something).
    scaler.scale(torch.ones((), device=pipe.device))
    return scaler
