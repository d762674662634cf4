"""Large GPU-format traces laid out as Kineto writes them, fast enough for gigabytes.

``TraceBuilder`` (``bench.harness.synthetic_traces``) builds every event as a dict and writes
``json.dumps`` of the whole trace: right for tests, slow for 128 MB files. This writer formats
the events with string templates in Kineto's own layout (one key block per line, indented; see
``libkineto``'s ``output_json.cpp``) a step at a time: per step a ``ProfilerStep#N`` range, then
per compute kernel its ``cpu_op``, ``cudaLaunchKernel`` (``correlation``), the kernel with the
keys Kineto gives kernels, and the ``ac2g`` flow pair; per NCCL collective its
``record_param_comms`` (``Process Group Name``, ``Seq``), launch and kernel with the same
metadata. ``distributedInfo`` names the rank, so files written for different ranks are
different ranks to any reader.
"""

from __future__ import annotations

import random
from pathlib import Path

_STEP = (
    '  {{\n    "ph": "X", "cat": "user_annotation", "name": "ProfilerStep#{n}", "pid": {pid}, '
    '"tid": {pid},\n    "ts": {ts:.3f}, "dur": {dur:.3f},\n    "args": {{\n      "External id": '
    '{ext},"Record function id": 0, "Ev Idx": {ext}\n    }}\n  }}'
)
_OP = (
    '  {{\n    "ph": "X", "cat": "cpu_op", "name": "aten::{op}", "pid": {pid}, "tid": {pid},\n'
    '    "ts": {ts:.3f}, "dur": {dur:.3f},\n    "args": {{\n      "External id": {ext},'
    '"Record function id": 0, "Sequence number": {ext}, "Fwd thread id": 0, "Ev Idx": {ext}\n'
    "    }}\n  }}"
)
_LAUNCH = (
    '  {{\n    "ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": {pid}, '
    '"tid": {pid},\n    "ts": {ts:.3f}, "dur": 3.000,\n    "args": {{\n      "External id": '
    '{ext},\n      "cbid": 211, "correlation": {corr}\n    }}\n  }}'
)
_KERNEL = (
    '  {{\n    "ph": "X", "cat": "kernel", "name": "{name}", "pid": 0, "tid": {stream},\n'
    '    "ts": {ts:.3f}, "dur": {dur:.3f},\n    "args": {{\n      "External id": {ext},\n'
    '{meta}      "queued": 0, "device": 0, "context": 1,\n      "stream": {stream}, '
    '"correlation": {corr},\n      "registers per thread": 32,\n      "shared memory": 0,\n'
    '      "blocks per SM": 0.5,\n      "warps per SM": 2.0,\n      "grid": [64, 1, 1],\n'
    '      "block": [128, 1, 1],\n      "est. achieved occupancy %": 12\n    }}\n  }}'
)
_FLOWS = (
    '  {{\n    "ph": "f", "id": {corr}, "pid": 0, "tid": {stream}, "ts": {ts:.3f},\n'
    '    "cat": "ac2g", "name": "ac2g", "bp": "e"\n  }},\n  {{\n    "ph": "s", "id": {corr}, '
    '"pid": {pid}, "tid": {pid}, "ts": {launch:.3f},\n    "cat": "ac2g", "name": "ac2g"\n  }}'
)
_META = (
    '      "Collective name": "allreduce", "In msg nelems": {nelems}, "Out msg nelems": '
    '{nelems},\n      "Group size": {world}, "dtype": "Float", "In split size": "[]", '
    '"Out split size": "[]",\n      "Process Group Name": "0", "Process Group Description": '
    '"default_pg", "Process Group Ranks": "{ranks}", "Rank": {rank}, "Seq": {seq},\n'
)
_PARAM_COMMS = (
    '  {{\n    "ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": {pid}, "tid": '
    '{pid},\n    "ts": {ts:.3f}, "dur": 4.000,\n    "args": {{\n      "External id": {ext},\n'
    '{meta}      "Record function id": 0, "Ev Idx": {ext}\n    }}\n  }}'
)
_NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"


def write_gpu_trace(path: Path, *, rank: int, world: int, target_mb: float, seed: int = 0) -> dict:
    """Write about ``target_mb`` MB (10^6 bytes) of one rank's GPU trace; return its shape."""
    rng = random.Random(seed * 1000 + rank)
    pid = 1000 + rank
    ranks = str(list(range(world)))
    head = (
        '{\n  "schemaVersion": 1,\n  "deviceProperties": [],\n  "distributedInfo": '
        f'{{"backend": "nccl", "rank": {rank}, "world_size": {world}, "pg_count": 1, '
        f'"pg_config": [{{"pg_name": "0", "pg_desc": "default_pg", "pg_size": {world}, '
        f'"ranks": {ranks}}}]}},\n  "host_name": "node{rank // 8}",\n  "traceEvents": [\n'
    )
    written = steps = kernels = 0
    ext = corr = seq = 1
    with path.open("w", encoding="utf-8") as out:
        out.write(head)
        first = True
        while written < target_mb * 1e6:
            start = 1.7e12 + steps * 20_000.0
            parts = [_STEP.format(n=steps, pid=pid, ts=start, dur=20_000.0, ext=ext)]
            ext += 1
            cursor = start + 10
            for k in range(240):
                dur = rng.uniform(5, 60)
                launch = cursor - 8
                parts.append(
                    _OP.format(op=f"op_{k % 17}", pid=pid, ts=launch - 2, dur=6.0, ext=ext)
                )
                parts.append(_LAUNCH.format(pid=pid, ts=launch, ext=ext, corr=corr))
                name = f"void kernel_{k % 23}<float, 4>(float*, float const*, int)"
                parts.append(
                    _KERNEL.format(
                        name=name, stream=7, ts=cursor, dur=dur, ext=ext, corr=corr, meta=""
                    )
                )
                parts.append(_FLOWS.format(corr=corr, stream=7, ts=cursor, pid=pid, launch=launch))
                ext, corr, kernels = ext + 1, corr + 1, kernels + 1
                cursor += dur + rng.uniform(0, 20)
                if k % 60 == 59:  # a bucket's all-reduce on the comm stream
                    meta = _META.format(
                        nelems=rng.randrange(1, 1 << 22),
                        world=world,
                        ranks=ranks,
                        rank=rank,
                        seq=seq,
                    )
                    parts.append(_PARAM_COMMS.format(pid=pid, ts=cursor - 6, ext=ext, meta=meta))
                    parts.append(_LAUNCH.format(pid=pid, ts=cursor - 4, ext=ext, corr=corr))
                    parts.append(
                        _KERNEL.format(
                            name=_NCCL,
                            stream=20,
                            ts=cursor,
                            dur=rng.uniform(100, 600),
                            ext=ext,
                            corr=corr,
                            meta=meta,
                        )
                    )
                    parts.append(
                        _FLOWS.format(corr=corr, stream=20, ts=cursor, pid=pid, launch=cursor - 4)
                    )
                    ext, corr, seq, kernels = ext + 1, corr + 1, seq + 1, kernels + 1
            text = ",\n".join(parts)
            out.write(text if first else ",\n" + text)
            first = False
            written += len(text)
            steps += 1
        out.write('\n  ],\n  "traceName": "synthetic"\n}\n')
    return {"steps": steps, "kernels": kernels, "mb": path.stat().st_size / 1e6}
