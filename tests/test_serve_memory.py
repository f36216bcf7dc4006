"""Peak memory of ``vexpert serve``'s processes on an expert-heavy checkpoint.

A Qwen3-MoE checkpoint of about 1.2 GB of float32 whose routed experts are 97% of the bytes
(tests/test_model_loading.py's ``_write_expert_heavy``, plus the offline tokenizer of
tests/serve_support.py) is served by ``vexpert serve --cpu-workers 2``. After /health turns 200 and one
completion, each process's peak RSS (``VmHWM``) must be what it keeps, not copies of the checkpoint:

* a worker (EP rank 0 or 1 of 2) holds the non-expert weights and half the experts, so it stays under
  0.6 × the checkpoint + 0.7 GB (the 0.7 GB: torch, transformers, gloo, the KV cache, slots);
* the coordinator holds the pool of every expert, so it stays under the expert bytes + 0.9 GB.

Reading through shards kept memory-mapped (every page touched stays resident while the handle lives)
or stacking a list of rows (a second copy of each layer) breaks these bounds. Two small tests pin the
mechanisms: :class:`CheckpointReader` maps no shard and writes rows in place (dense, bf16 cast, block
FP8), and :class:`ExpertPool` reads into its buffers, or loads in bounded chunks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime_support import TINY_DEEPSEEK_SPEC, TINY_FP8_DEEPSEEK_SPEC, wait_healthy
from vexpert_runtime.model.checkpoint import (
    PROJECTIONS,
    SCALE_SUFFIX,
    CheckpointReader,
    MoESpec,
    expert_tensor,
    write_tiny_checkpoint,
)
from vexpert_runtime.model.weights import pack_expert
from vexpert_runtime.node import expert_pool
from vexpert_runtime.node.expert_pool import ExpertPool

pytest.importorskip("transformers")

from serve_support import build_tiny_checkpoint
from test_model_loading import EXPERTS, _header_bytes, _write_expert_heavy

GB = 1e9
MIB = 2**20
HEALTH_TIMEOUT_S = 180.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _mapped(path: Path) -> list[str]:
    """Lines of /proc/self/maps that map a file under ``path``."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(path) in line]


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads /proc/self/maps")
@pytest.mark.parametrize(("spec", "dtype"), [(TINY_DEEPSEEK_SPEC, torch.float32), (TINY_DEEPSEEK_SPEC, torch.bfloat16),
                                             (TINY_FP8_DEEPSEEK_SPEC, torch.float32)], ids=["f32", "bf16", "fp8"])
def test_reader_maps_no_shard_and_writes_rows_in_place(tmp_path: Path, spec: MoESpec, dtype: torch.dtype) -> None:
    write_tiny_checkpoint(tmp_path, spec, shards=3)
    stored: dict[str, torch.Tensor] = {}
    for shard in tmp_path.glob("*.safetensors"):  # copies: load_file's tensors map the shard
        stored.update({name: t.clone() for name, t in load_file(str(shard)).items()})
    assert _mapped(tmp_path) == []
    reader = CheckpointReader(tmp_path, spec)
    reader.validate()
    fmt = spec.expert_format(dtype)
    ids = [3, 0, 2]
    out = torch.full((len(ids), fmt.row_numel), 7, dtype=fmt.row_dtype)
    assert reader.experts(1, ids, dtype, out=out) is out
    layer = spec.moe_layers[1]
    for i, expert in enumerate(ids):
        names = {p: expert_tensor(layer, expert, p) for p in PROJECTIONS}
        if fmt.fp8_block is None:
            want = pack_expert(*(stored[n].to(dtype) for n in names.values()))
        else:
            want = fmt.pack_fp8({p: stored[n] for p, n in names.items()},
                                {p: stored[n + SCALE_SUFFIX] for p, n in names.items()})
        assert torch.equal(out[i], want), (i, expert)
        assert torch.equal(reader.expert(1, expert, dtype), want)
    assert torch.equal(reader.experts(1, ids, dtype), out)
    # a strided destination goes through one staging row
    wide = torch.zeros(len(ids), 2 * fmt.row_numel, dtype=fmt.row_dtype)
    reader.experts(1, ids, dtype, out=wide[:, ::2])
    assert torch.equal(wide[:, ::2], out)
    with pytest.raises(ValueError, match="out is"):
        reader.experts(1, ids, dtype, out=out[:2])
    assert _mapped(tmp_path) == []  # nothing read stays mapped (nor resident beyond what was returned)


def test_pool_reads_into_its_buffers_or_loads_in_bounded_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = TINY_DEEPSEEK_SPEC
    write_tiny_checkpoint(tmp_path, spec)
    reader = CheckpointReader(tmp_path, spec)
    calls: list[int] = []

    def load(layer: int, experts: list[int]) -> torch.Tensor:
        calls.append(len(experts))
        return reader.experts(layer, experts, torch.float32)

    def alloc(rows: int, numel: int) -> torch.Tensor:
        return torch.empty(rows, numel)

    row_bytes = spec.expert_numel * 4
    monkeypatch.setattr(expert_pool, "LOAD_CHUNK_BYTES", 3 * row_bytes)
    pooled = torch.tensor([[0, 1, 2, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7]])
    chunked = ExpertPool.build(pooled, spec.num_experts, spec.expert_numel, load, alloc)
    assert calls == [3, 3, 1, 3, 3, 1]  # never more than a chunk beside the pool
    targets: list[int] = []

    def read_into(layer: int, experts: list[int], out: torch.Tensor) -> None:
        targets.append(out.data_ptr())
        reader.experts(layer, experts, torch.float32, out=out)

    calls.clear()
    direct = ExpertPool.build(pooled, spec.num_experts, spec.expert_numel, load, alloc, read_into)
    assert calls == [] and targets == [b.data_ptr() for b in direct.buffers]
    for layer in range(2):
        assert torch.equal(direct.buffers[layer], chunked.buffers[layer])
        assert torch.equal(direct.buffers[layer], reader.experts(layer, pooled[layer].tolist(), torch.float32))
    # refreshed: kept rows copied from the pool, new ones read in runs straight into the new buffer
    wanted = torch.tensor([[0, 1, 2, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6]])
    for read in (None, read_into):
        new = direct.refreshed(wanted, load, alloc, read)
        assert new.buffers[0] is direct.buffers[0]
        assert torch.equal(new.buffers[1], reader.experts(1, wanted[1].tolist(), torch.float32))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _status(pid: int, key: str) -> int:
    """A ``/proc/<pid>/status`` field in bytes (kB there)."""
    with open(f"/proc/{pid}/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(key + ":"))


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's), oldest first."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.update(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue  # the thread ended
    return sorted(found, key=_start_time)


def _start_time(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22: starttime (clock ticks)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def _write_model(path: Path) -> None:
    """The expert-heavy checkpoint and the tiny checkpoint's tokenizer (its 400 tokens < the model's
    1024-entry vocabulary)."""
    _write_expert_heavy(path)
    with tempfile.TemporaryDirectory() as tiny:
        build_tiny_checkpoint(Path(tiny))
        for name in TOKENIZER_FILES:
            if (Path(tiny) / name).is_file():
                shutil.copy(Path(tiny) / name, path / name)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (a clean drain), then the whole process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmHWM from /proc")
def test_serve_peak_rss_is_what_each_process_keeps(tmp_path: Path) -> None:
    path = tmp_path / "expert_heavy"
    path.mkdir()
    log = tmp_path / "serve.log"
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    try:
        _write_model(path)
        sizes = _header_bytes(path)
        file_bytes = sum(shard.stat().st_size for shard in path.glob("*.safetensors"))
        expert_bytes = sum(size for name, size in sizes.items() if EXPERTS in name)
        assert 1.0 * GB < file_bytes < 1.3 * GB and expert_bytes > 0.9 * file_bytes
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "vexpert_runtime", "serve", "--model", str(path), "--host", "127.0.0.1",
                 "--port", str(port), "--cpu-workers", "2", "--kv-cache-tokens", "2048"],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        try:
            wait_healthy(proc, base, log, HEALTH_TIMEOUT_S)
            body = json.dumps({"model": path.name, "prompt": "hello world", "max_tokens": 4}).encode()
            request = urllib.request.Request(base + "/v1/completions", data=body,
                                             headers={"content-type": "application/json"})
            answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
            assert answer["usage"]["completion_tokens"] >= 1, answer
            nodes = [pid for pid in _children(proc.pid) if "resource_tracker" not in _cmdline(pid)]
            assert len(nodes) == 1, [(pid, _cmdline(pid)) for pid in _children(proc.pid)]  # the node process
            children = [pid for pid in _children(nodes[0]) if "resource_tracker" not in _cmdline(pid)]
            # spawned in this order: the workers (ranks 0, 1), then the coordinator
            assert len(children) == 3, [(pid, _cmdline(pid)) for pid in _children(nodes[0])]
            *workers, coordinator = children
            peaks = {f"worker {rank}": _status(pid, "VmHWM") for rank, pid in enumerate(workers)}
            peaks["coordinator"] = _status(coordinator, "VmHWM")
            peaks["node"] = _status(nodes[0], "VmHWM")
            peaks["api"] = _status(proc.pid, "VmHWM")
        finally:
            _stop(proc)
        served = log.read_text(errors="replace")
        for rank in range(2):  # each CPU worker says which expert kernel it timed faster on this machine
            assert re.search(rf"vexpert-worker-{rank}: CPU experts run (grouped|prepacked) \(one pass over layer 0: "
                             r"grouped [0-9.]+ ms, prepacked [0-9.]+ ms\)", served), served[-2000:]
    finally:
        shutil.rmtree(path, ignore_errors=True)
    print(f"\ncheckpoint {file_bytes / MIB:.0f} MiB (experts {expert_bytes / MIB:.0f} MiB); peak RSS (VmHWM): "
          + ", ".join(f"{name} {peak / MIB:.0f} MiB = {peak / file_bytes:.2f}×" for name, peak in peaks.items()))
    for rank in range(2):
        assert peaks[f"worker {rank}"] < 0.6 * file_bytes + 0.7 * GB, peaks
    assert peaks["coordinator"] < expert_bytes + 0.9 * GB, peaks
    # the node process (supervisor, allocator) and the API process hold no weights (316 / 424 MiB here)
    assert peaks["node"] < 0.6 * GB and peaks["api"] < 0.8 * GB, peaks
