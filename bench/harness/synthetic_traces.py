"""Hand-built Kineto traces with known answers, for tests and the analysis-speed benchmark.

The events have the shape ``torch.profiler`` writes (torch 2.x, Kineto): ``ProfilerStep#N`` ranges,
``cpu_op`` ranges, ``gloo:*`` ranges on gloo threads; on GPU, kernels on streams with a
``cudaLaunchKernel`` call carrying the same ``correlation`` id, ``ac2g`` flow arrows, NCCL
collective metadata and the ``gpu_user_annotation`` mirror of ``nccl:*`` ranges. Times are µs.

Example::
    >>> t = TraceBuilder(rank=1, world_size=2)
    >>> t.step(5, 0, 100)
    >>> t.kernel("sgemm", 10, 60, launch_at=5)
    >>> t.kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 40, 90, launch_at=8,
    ...          collective="allreduce", nelems=1024, stream=20)
    >>> t.write(tmp_path / "rank1.1.pt.trace.json")
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

GPU_PID = 0
GLOO_TID = 9001


class TraceBuilder:
    """Collects events for one rank's trace file.

    Args:
        rank (int): written to ``distributedInfo``. Defaults to 0.
        world_size (int): written to ``distributedInfo``. Defaults to 2.
        backend (str): written to ``distributedInfo``. Defaults to ``"nccl"``.
        distributed (bool): False leaves ``distributedInfo`` out. Defaults to True.
        groups (list[dict] | None): ``distributedInfo.pg_config`` entries (``pg_name``,
            ``ranks``); None leaves it out. Defaults to None.
        host (str | None): the ``host_name`` key; None leaves it out. Defaults to None.
        pid (int): the process id of the CPU threads. Defaults to 4242.
        main_tid (int): the training loop's thread id. Defaults to 4242.
    """

    def __init__(
        self,
        *,
        rank: int = 0,
        world_size: int = 2,
        backend: str = "nccl",
        distributed: bool = True,
        pid: int = 4242,
        main_tid: int = 4242,
        groups: list[dict[str, Any]] | None = None,
        host: str | None = None,
    ):
        self.rank = rank
        self.groups = groups
        self.host = host
        self.world_size = world_size
        self.backend = backend
        self.distributed = distributed
        self.pid = pid
        self.main_tid = main_tid
        self.events: list[dict[str, Any]] = []
        self._next_id = 1
        self._streams: set[int] = set()

    def _id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _range(
        self,
        cat: str,
        name: str,
        start: float,
        end: float,
        *,
        pid: Any,
        tid: Any,
        args: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        event = {
            "ph": "X",
            "cat": cat,
            "name": name,
            "pid": pid,
            "tid": tid,
            "ts": start,
            "dur": end - start,
            "args": {"External id": self._id(), **(args or {})},
        }
        self.events.append(event)
        return event

    def step(self, number: int, start: float, end: float) -> None:
        """A ``ProfilerStep#number`` range on the main thread."""
        self._range(
            "user_annotation", f"ProfilerStep#{number}", start, end, pid=self.pid, tid=self.main_tid
        )

    def user_annotation(
        self, name: str, start: float, end: float, *, tid: int | None = None
    ) -> None:
        """A ``user_annotation`` range such as ``enumerate(DataLoader)#...`` on the main thread."""
        tid = self.main_tid if tid is None else tid
        self._range("user_annotation", name, start, end, pid=self.pid, tid=tid)

    def cpu_op(
        self,
        name: str,
        start: float,
        end: float,
        *,
        tid: int | None = None,
        args: dict[str, Any] | None = None,
    ) -> None:
        """A ``cpu_op`` range (on the main thread unless ``tid`` is given)."""
        self._range(
            "cpu_op",
            name,
            start,
            end,
            pid=self.pid,
            tid=self.main_tid if tid is None else tid,
            args=args,
        )

    def gloo(
        self,
        kind: str,
        start: float,
        end: float,
        *,
        tid: int = GLOO_TID,
        nelems: int | None = None,
        dtype: str = "float",
    ) -> None:
        """A ``gloo:<kind>`` range on a gloo worker thread (shapes as ``record_shapes`` gives)."""
        args = {"Input Dims": [[nelems]], "Input type": [dtype]} if nelems is not None else {}
        self._range("user_annotation", f"gloo:{kind}", start, end, pid=self.pid, tid=tid, args=args)

    def kernel(
        self,
        name: str,
        start: float,
        end: float,
        *,
        stream: int = 7,
        launch_at: float | None = None,
        launch_tid: int | None = None,
        collective: str | None = None,
        nelems: int | None = None,
        dtype: str = "Float",
        metadata_on_kernel: bool = True,
        mirror: bool = True,
        seq: int | None = None,
        group: str = "0",
        group_ranks: list[int] | None = None,
        flows: bool = True,
        ranks_in_metadata: bool = True,
    ) -> None:
        """A GPU kernel; with ``launch_at``, also its launch call and flow arrow.

        Args:
            collective (str | None): a ``Collective name`` such as ``"allreduce"``: the kernel is
                then launched inside ``record_param_comms`` and ``nccl:<collective>`` ranges,
                whose ``gpu_user_annotation`` mirror is drawn on the stream when ``mirror``.
            metadata_on_kernel (bool): put the collective metadata on the kernel itself (newer
                Kineto) rather than only on ``record_param_comms``.
            seq (int | None): the collective's ``Seq`` in its group (torch >= 2.4 writes it);
                None leaves it out.
            group (str): its ``Process Group Name``. Defaults to ``"0"``.
            group_ranks (list[int] | None): its ``Process Group Ranks`` (written as a string,
                as Kineto does); None: ranks 0 .. world_size - 1.
            flows (bool): also write the ``ac2g`` flow arrow of the launch (the analysis reads
                ``correlation``, not flows). Defaults to True.
            ranks_in_metadata (bool): write ``Process Group Ranks`` (5 KB for 1,024 ranks, on
                every collective; the groups are in ``pg_config`` too). Defaults to True.
        """
        self._streams.add(stream)
        correlation = self._id()
        tid = self.main_tid if launch_tid is None else launch_tid
        meta = {}
        if collective is not None:
            meta = {
                "Collective name": collective,
                "dtype": dtype,
                "Group size": self.world_size,
                "Process Group Name": group,
                "Process Group Description": "default_pg" if group == "0" else f"pg{group}",
            }
            if ranks_in_metadata:
                ranks = list(range(self.world_size)) if group_ranks is None else group_ranks
                meta["Process Group Ranks"] = str(ranks)
            if seq is not None:
                meta["Seq"] = seq
            if nelems is not None:
                meta |= {"In msg nelems": nelems, "Out msg nelems": nelems}
        args = {
            "device": 0,
            "stream": stream,
            "correlation": correlation,
            "grid": [1, 1, 1],
            "block": [512, 1, 1],
            "registers per thread": 32,
            "shared memory": 0,
        }
        external = None
        if collective is not None and launch_at is not None:
            outer = self._range(
                "user_annotation",
                f"nccl:{collective}",
                launch_at - 1,
                launch_at + 3,
                pid=self.pid,
                tid=tid,
            )
            record = self._range(
                "cpu_op",
                "record_param_comms",
                launch_at - 0.5,
                launch_at + 2,
                pid=self.pid,
                tid=tid,
                args=meta,
            )
            external = record["args"]["External id"]
            if mirror:
                self._range(
                    "gpu_user_annotation",
                    outer["name"],
                    start,
                    end,
                    pid=GPU_PID,
                    tid=stream,
                    args={"External id": outer["args"]["External id"]},
                )
        if metadata_on_kernel:
            args |= meta
        kernel = self._range("kernel", name, start, end, pid=GPU_PID, tid=stream, args=args)
        if external is not None:
            kernel["args"]["External id"] = external
        if launch_at is not None:
            self._range(
                "cuda_runtime",
                "cudaLaunchKernel",
                launch_at,
                launch_at + 1,
                pid=self.pid,
                tid=tid,
                args={"cbid": 211, "correlation": correlation},
            )
            if flows:
                flow = {"id": correlation, "cat": "ac2g", "name": "ac2g"}
                self.events.append(
                    {"ph": "s", "pid": self.pid, "tid": tid, "ts": launch_at, **flow}
                )
                self.events.append(
                    {"ph": "f", "bp": "e", "pid": GPU_PID, "tid": stream, "ts": start, **flow}
                )

    def metadata(self) -> list[dict[str, Any]]:
        """Process and thread name events, as Kineto writes them."""

        def meta(name: str, pid: Any, tid: Any, value: Any) -> dict[str, Any]:
            return {"ph": "M", "name": name, "pid": pid, "tid": tid, "ts": 0, "args": value}

        events = [
            meta("process_name", self.pid, 0, {"name": "python"}),
            meta(
                "thread_name", self.pid, self.main_tid, {"name": f"thread {self.main_tid} (python)"}
            ),
            meta("thread_name", self.pid, GLOO_TID, {"name": "pt_gloo_runloop"}),
        ]
        if self._streams:
            events.append(meta("process_name", GPU_PID, 0, {"name": "python"}))
            events.append(meta("process_labels", GPU_PID, 0, {"labels": "GPU 0"}))
            events += [
                meta("thread_name", GPU_PID, s, {"name": f"stream {s} "})
                for s in sorted(self._streams)
            ]
        return events

    def header(self) -> dict[str, Any]:
        """The top-level keys other than ``traceEvents``."""
        head: dict[str, Any] = {"schemaVersion": 1, "deviceProperties": []}
        if self.host is not None:
            head["host_name"] = self.host
        if self.distributed:
            head["distributedInfo"] = {
                "backend": self.backend,
                "rank": self.rank,
                "world_size": self.world_size,
            }
            if self.groups is not None:
                head["distributedInfo"]["pg_count"] = len(self.groups)
                head["distributedInfo"]["pg_config"] = [
                    {"pg_name": g["pg_name"], "pg_size": len(g["ranks"]), "ranks": g["ranks"]}
                    for g in self.groups
                ]
        return head

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.header(),
            "traceEvents": self.metadata() + self.events,
            "traceName": f"rank{self.rank}",
            "displayTimeUnit": "ms",
            "baseTimeNanoseconds": 1_700_000_000_000_000_000,
        }

    def write(self, path: str | Path) -> Path:
        """Write the trace (gzip-compressed when ``path`` ends in ``.gz``)."""
        path = Path(path)
        text = json.dumps(self.to_dict())
        if path.name.endswith(".gz"):
            with gzip.open(path, "wt", encoding="utf-8") as f:
                f.write(text)
        else:
            path.write_text(text, encoding="utf-8")
        return path
