"""Task lanes (sdadapt._engine.lanes): only the threads that hold a band buffer take
computations, and they take plain tasks too once no computation waits; the other threads
take only plain tasks. Through the engine, a load that dequantises next to plain reads runs
its computations on the computing threads only, and its plain reads on every thread."""

from __future__ import annotations

import threading

import torch
from support.checkpoints import write_safetensors

import sdadapt._recipes.nodes as N
from sdadapt._engine import EngineConfig, IOEngine, Job
from sdadapt._engine import workers as W
from sdadapt._engine.lanes import TaskQueues, uses_band
from sdadapt._engine.tasks import ComputeTask, FillTask, Where
from sdadapt._recipes import quant as Q
from sdadapt._recipes import quant_nodes as QN
from sdadapt.sources import open_source

WHERE = Where("t", "t", "file", ((0, 2),))


def _compute_task() -> ComputeTask:
    node = N.Leaf("w", (2,), torch.float32)
    step = N.Compute(node, ((0, 2),), torch.empty(2), kernel=N.Kernel(lambda dest: None, "none", ((0, 2),)))
    return ComputeTask(step, WHERE)


def _plain_task() -> FillTask:
    return FillTask(N.Fill(torch.empty(2), 0.0), WHERE)


def test_only_computing_threads_take_computations_and_they_go_first():
    lanes = TaskQueues()
    band, plain = _compute_task(), _plain_task()
    assert uses_band(band) and not uses_band(plain)
    lanes.put(plain)
    lanes.put(band)
    assert lanes.get(computes=False) is plain  # a plain thread never sees the computation
    lanes.put(plain)
    assert lanes.get(computes=True) is band  # a computing thread takes computations first
    assert lanes.get(computes=True) is plain  # then plain tasks
    lanes.close()
    assert lanes.get(computes=True) is None and lanes.get(computes=False) is None


def test_closing_drains_queued_tasks_first_and_wakes_every_waiting_thread():
    lanes = TaskQueues()
    band = _compute_task()
    lanes.put(band)
    got: dict[str, object] = {}

    def take(name: str, computes: bool) -> None:
        got[name] = lanes.get(computes)

    plain_thread = threading.Thread(target=take, args=("plain", False))
    plain_thread.start()
    plain_thread.join(0.2)
    assert plain_thread.is_alive()  # waits: the one task queued is a computation
    lanes.close()
    plain_thread.join(5)
    assert not plain_thread.is_alive() and got["plain"] is None
    assert lanes.get(computes=True) is band  # queued before closing: still handed out
    assert lanes.get(computes=True) is None


def test_a_queued_task_wakes_a_thread_that_can_run_it():
    lanes = TaskQueues()
    got: dict[str, object] = {}
    ready = threading.Barrier(3)

    def take(name: str, computes: bool) -> None:
        ready.wait()
        got[name] = lanes.get(computes)

    threads = [threading.Thread(target=take, args=(n, c)) for n, c in (("computing", True), ("plain", False))]
    for th in threads:
        th.start()
    ready.wait()
    band, plain = _compute_task(), _plain_task()
    lanes.put(band)  # only the computing thread can take it
    threads[0].join(5)
    assert got.get("computing") is band
    lanes.put(plain)
    threads[1].join(5)
    assert got.get("plain") is plain
    lanes.close()


def test_engine_runs_computations_on_computing_threads_only(tmp_path, monkeypatch):
    """One band buffer (staging bounded to one band): one thread computes the FP8 regions,
    the other threads read the plain tensors; every value is bit-exact against the eager
    dequantisation and the source."""
    block = (16, 16)
    g = torch.Generator().manual_seed(0)
    w, s = Q.quantize_fp8(torch.randn(128, 64, generator=g), block, "float32")
    plain = {f"p{i}": torch.randn(32, 64, generator=g).to(torch.bfloat16) for i in range(6)}
    path = write_safetensors(tmp_path / "m.safetensors", {"w": w, "w_scale_inv": s, **plain})
    scale = N.Leaf("w_scale_inv", tuple(s.shape), s.dtype)
    node = QN.DequantizedFP8(N.Leaf("w", (128, 64), w.dtype), scale, block, "float32", torch.bfloat16)
    want = Q.dequantize_fp8(w, s, block, "float32", torch.bfloat16)
    ran: list[tuple[bool, str]] = []  # (the thread computes, the task's kind)
    lock = threading.Lock()
    original = W.Worker._run

    def recording(self, task):
        with lock:
            ran.append((self.computes, type(task).__name__))
        return original(self, task)

    made: list[bool] = []  # each thread's ``computes``
    init = W.Worker.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self.computes)

    monkeypatch.setattr(W.Worker, "_run", recording)
    monkeypatch.setattr(W.Worker, "__init__", recording_init)
    cfg = EngineConfig(threads=3, band_bytes=2048, staging_bytes=2048, chunk_bytes=4096, direct_min_bytes=1 << 40)
    with open_source(path) as src:
        dest = torch.empty(128, 64, dtype=torch.bfloat16)
        jobs = [Job("w", node, ((0, 128), (0, 64)), dest)]
        outs = {k: torch.empty(32, 64, dtype=torch.bfloat16) for k in plain}
        jobs += [Job(k, N.Leaf(k, (32, 64), torch.bfloat16), ((0, 32), (0, 64)), outs[k]) for k in plain]
        stats = IOEngine(src, cfg).run(jobs)
    assert torch.equal(dest, want) and all(torch.equal(outs[k], plain[k]) for k in plain)
    computed = [c for c, kind in ran if kind == "ComputeTask"]
    assert len(computed) == 4 and all(computed)  # 128 rows in bands of 2048 bytes: 4, all on the computing thread
    assert stats.threads == 3 and sum(1 for c, kind in ran if kind != "ComputeTask") == len(plain)
    assert sorted(made) == [False, False, True]  # one band buffer: one of the three threads computes
