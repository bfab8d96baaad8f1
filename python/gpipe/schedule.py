"""Schedules as data: torch.distributed.pipelining's CSV action tables, for ``schedule=``."""
import os
from typing import List, Union

from gpipe import _C

__all__ = ["Schedule"]


class Schedule:
    """A training step's order given as data: one row of compute actions per device (in
    process) or per rank (``gpipe.distributed.Pipe``), in torch.distributed.pipelining's CSV
    format (``"compute_only"``, as torchtitan's custom CSV schedules). Each action is
    ``<stage><F|I|W|B><micro-batch>``: ``0F3`` the forward of micro-batch 3 on stage 0,
    ``1B2`` a whole backward, ``1I2`` / ``1W2`` its input-grad and weight-grad halves
    (zero-bubble); an empty cell is an idle tick; DualPipeV's overlapped cell
    ``(0F7;7B3)OVERLAP_F_B`` runs as its two actions, one after the other. gpipe derives the
    communication, so the format's communication and FSDP actions (``SEND_F``, ``UNSHARD``,
    ...) are refused. Stage
    s runs on row s mod rows (more stages than rows: virtual stages, as interleaved 1F1B), or,
    with twice as many stages as rows, in ZB-V's V (row r: stages r and 2 rows - 1 - r, as
    pipelining's ScheduleZBVZeroBubble and DualPipeV place them; ``v_shaped``).

    Pass it as ``schedule=`` to :class:`gpipe.Pipe` or :class:`gpipe.distributed.Pipe`, with
    ``chunks`` equal to its micro-batches and a ``balance`` of its stages::

        schedule = gpipe.Schedule.from_csv("my_schedule.csv")
        pipe = gpipe.Pipe(model, balance=[2, 2], chunks=schedule.microbatches,
                          schedule=schedule)

    A table is checked when made: a cell that is not an action, an action in a row its stage
    does not run on, a missing or repeated action, or a table that deadlocks (naming the
    actions each blocked row waits on) raises ValueError. ``pipe.schedule_csv()`` gives the
    table any pipe runs (built-in schedules too), to edit and load back.

    Attributes:
        rows: devices or ranks the table is for.
        stages: stages it names (a multiple of ``rows``).
        microbatches: micro-batches it runs.
        csv: the table as CSV text, idle cells left out.
        v_shaped: whether its stages lie in a V (else a loop).
    """

    def __init__(self, csv: str) -> None:
        if not isinstance(csv, str):
            raise TypeError(f"Schedule takes the CSV text, got {type(csv).__name__}; use "
                            f"Schedule.from_csv(path) for a file or Schedule.from_rows(rows)")
        (self.rows, self.stages, self.microbatches, self.csv,
         self.v_shaped) = _C.parse_schedule_csv(csv)

    @classmethod
    def from_csv(cls, path: Union[str, "os.PathLike[str]"]) -> "Schedule":
        """The schedule in the CSV file at ``path`` (as torch's ``_dump_csv`` writes)."""
        with open(path, newline="") as f:
            return cls(f.read())

    @classmethod
    def from_rows(cls, rows: List[List[str]]) -> "Schedule":
        """The schedule of one list of actions per row, e.g. ``[["0F0", "0B0"], ...]`` (None or
        ``""`` for an idle tick, as torch's ``pipeline_order`` holds)."""
        return cls("\n".join(",".join("" if a is None else str(a) for a in row)
                             for row in rows) + "\n")

    def to_rows(self) -> List[List[str]]:
        """The actions of each row, in order."""
        return [line.split(",") if line else [] for line in self.csv.splitlines()]

    def save(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Writes the table to ``path`` (torch's ``_load_csv`` reads it)."""
        with open(path, "w", newline="") as f:
            f.write(self.csv)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule) and self.csv == other.csv

    def __hash__(self) -> int:
        return hash(self.csv)

    def __repr__(self) -> str:
        return (f"gpipe.Schedule({self.rows} rows, {self.stages} stages, "
                f"{self.microbatches} micro-batches)")
