"""A process that exits while its background save is in flight (issue 62, item 4).

Each of 2 gloo ranks trains an FSDP2 model, saves it (``prev``), trains a step, starts
``save_state(..., async_=True)`` (``new``: its first background save, so the writing thread is
still making its gloo group too) and returns from its main at once: once with the world still
up, once after ``destroy_process_group()``. sdadapt's exit handler lets the save end (or fail)
before the interpreter finalizes: every rank exits 0, with no "terminate called" abort, and
``prev`` stays complete; with the world up, ``new`` is complete too and holds the state as it was
when the call returned. With the world destroyed under it, the save fails (a writer that finds
the world gone never writes its rank's shards as a single process's checkpoint), or a writer
still making its group for a rank that already gave up is left after
``background.DESTROYED_WAIT_S``. A program's own ``atexit`` handler registered after sdadapt's
(``atexit`` runs the last registered first) that destroys the world and calls ``os._exit`` finds
the save complete: sdadapt waits for it as the main thread ends, before any ``atexit`` handler.
With the world up and a peer that never joins the save, exit gives it up after
``SDADAPT_EXIT_WAIT_S``, and the folder is not complete; a save given up mid-write stops at its
next file write, so the process still exits without an abort.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from support.dist_helper import SRC_DIR, TESTS_DIR
from support.models import TinyTransformer

import sdadapt
from sdadapt._state import background
from sdadapt._state.checkpointer import complete

WORLD = 2

RANK = textwrap.dedent(
    """
    import atexit, os, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from support.models import TinyTransformer, parallelize
    from support.training import train_steps
    import sdadapt

    def main(folder: str, rank: int, how: str) -> None:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
        torch.manual_seed(0)
        model = parallelize(TinyTransformer(), init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",)))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        train_steps(model, opt, 1)
        sdadapt.save_state(model, os.path.join(folder, "prev"), opt)
        train_steps(model, opt, 1)
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(full, os.path.join(folder, "wanted.pt"))
        sdadapt.save_state(model, os.path.join(folder, "new"), opt, extra={"step": 2}, async_=True)
        if how == "destroy":
            dist.destroy_process_group()
        if how == "atexit":  # the program's own exit handler, registered after sdadapt's (so run before it)

            def bye() -> None:
                dist.destroy_process_group()
                os._exit(0)

            atexit.register(bye)
        train_steps(model, opt, 1) if how != "destroy" else None  # the model changes while the save writes

    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    """
)


@pytest.mark.parametrize("how", ["up", "destroy", "atexit"])
def test_exit_with_a_save_in_flight(tmp_path, how):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    folder = tmp_path / "run"
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC_DIR), str(TESTS_DIR)]), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path), "PYTHONFAULTHANDLER": "1"}  # fmt: skip
    procs = [subprocess.Popen([sys.executable, str(script), str(folder), str(r), how], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and "terminate called" not in out, f"rank {r} rc {p.returncode}:\n{out[-3000:]}"
    assert complete(str(folder / "prev"))  # with the world destroyed under it, the new save fails (logged at exit)
    if how != "destroy":
        assert complete(str(folder / "new"))
        back = TinyTransformer()
        sdadapt.load_state(back, str(folder / "new"))
        wanted = torch.load(folder / "wanted.pt")
        assert all(torch.equal(back.state_dict()[k], v) for k, v in wanted.items())


STALLED = textwrap.dedent(
    """
    import logging, os, sys, time
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from support.models import TinyTransformer, parallelize
    from support.training import train_steps
    import sdadapt

    def main(folder: str, rank: int) -> None:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
        torch.manual_seed(0)
        model = parallelize(TinyTransformer(), init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",)))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        train_steps(model, opt, 1)
        sdadapt.save_state(model, os.path.join(folder, "prev"), opt, async_=True).wait()  # the saves' group made
        train_steps(model, opt, 1)
        if rank == 0:  # its peer never joins this save: the write waits for it past the exit's bound
            from sdadapt._state import background

            background.STOP_WAIT_S = 1.0  # the wait for a writer to stop at a file write (it waits in a collective)
            sdadapt.save_state(model, os.path.join(folder, "new"), opt, async_=True)
            print("exit begins", time.monotonic(), flush=True)
            return
        deadline = time.monotonic() + 180  # alive (the save's group up) until rank 0 has exited
        while not os.path.exists(os.path.join(folder, "release")) and time.monotonic() < deadline:
            time.sleep(0.1)

    main(sys.argv[1], int(sys.argv[2]))
    """
)


def test_exit_gives_up_a_save_past_its_bound(tmp_path):
    """With the world up, exit waits ``SDADAPT_EXIT_WAIT_S`` for a background save whose peer
    never joins, logs the folder it waits for, then gives it up, naming the folder: the process
    exits 0 without an abort, the folder is not a complete checkpoint, and the one before is."""
    script = tmp_path / "rank.py"
    script.write_text(STALLED)
    folder = tmp_path / "run"
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC_DIR), str(TESTS_DIR)]), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path), "PYTHONFAULTHANDLER": "1", "SDADAPT_EXIT_WAIT_S": "3"}  # fmt: skip
    procs = [subprocess.Popen([sys.executable, str(script), str(folder), str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]  # fmt: skip
    try:
        out0 = procs[0].communicate(timeout=240)[0]
        ended = time.monotonic()
        (folder / "release").touch()
        out1 = procs[1].communicate(timeout=240)[0]
    finally:
        for p in procs:
            p.kill()
    new = str(folder / "new")
    assert procs[0].returncode == 0 and "terminate called" not in out0, out0[-3000:]
    assert procs[1].returncode == 0 and "terminate called" not in out1, out1[-3000:]
    assert f"waiting up to 3 s for the save to {new}" in out0, out0[-3000:]
    assert f"the save to {new} in the background did not end 3 s after" in out0 and "given up" in out0, out0[-3000:]
    began = float(out0.split("exit begins ")[1].split()[0])
    assert 3 <= ended - began < 60  # waited its bound, not the save's collectives' own timeout (30 min)
    assert complete(str(folder / "prev")) and not complete(new)


def test_exit_wait_from_the_environment(monkeypatch, caplog):
    monkeypatch.delenv("SDADAPT_EXIT_WAIT_S", raising=False)
    assert background.exit_wait_s() == background.EXIT_WAIT_S == 600
    for raw, want in [("5", 5.0), (" 0.5 ", 0.5), ("inf", None), ("-1", 0.0), ("soon", background.EXIT_WAIT_S)]:
        monkeypatch.setenv("SDADAPT_EXIT_WAIT_S", raw)
        assert background.exit_wait_s() == want, raw
    assert "SDADAPT_EXIT_WAIT_S='soon' is not a number of seconds" in caplog.text


def test_a_given_up_save_is_never_marked_complete(tmp_path, monkeypatch):
    """A writer that runs on after exit gave its save up writes no ``sdadapt.json``: the folder
    never counts as complete, and the handle says why. Over a complete checkpoint
    (``overwrite=True``), its record and checksums are gone before anything is written, so the
    old ``sdadapt.json`` beside the new ``.metadata`` never makes the folder look complete. (The
    give-up here comes once DCP's files are written: DCP's own writer, which does not stop.)"""
    from torch.distributed.checkpoint import FileSystemWriter

    from sdadapt._state import saving

    monkeypatch.setattr(saving, "storage_writer", FileSystemWriter)
    model = TinyTransformer()
    cut = tmp_path / "cut"
    sdadapt.save_state(model, str(cut), checksums=True)
    assert complete(str(cut)) and (cut / "sdadapt.checksums.json").is_file()
    given_up = threading.Event()
    given_up.set()
    monkeypatch.setattr(background, "_GIVEN_UP", given_up)
    pending = sdadapt.save_state(model, str(cut), async_=True, overwrite=True)
    with pytest.raises(sdadapt.errors.StateError, match="given up at exit"):
        pending.wait()
    assert (cut / ".metadata").is_file() and not (cut / "sdadapt.json").exists()
    assert not complete(str(cut)) and not (cut / "sdadapt.checksums.json").exists()


def test_exit_waits_for_a_save_without_a_process_group(monkeypatch, caplog):
    """The short wait for a world destroyed under a save is not applied to a process that never
    saved over one: its save is waited for (here past the short wait), and not given up."""
    monkeypatch.setattr(background, "DESTROYED_WAIT_S", 0.1)
    monkeypatch.setattr(background, "_WORLD", threading.Event())
    monkeypatch.setattr(background, "_GIVEN_UP", threading.Event())
    background.start_writer().put(lambda: time.sleep(1.0))  # a write that outlasts the short wait
    t0 = time.monotonic()
    with caplog.at_level("INFO"):
        background.finish_at_exit()
    assert time.monotonic() - t0 >= 0.9 and not background.given_up() and "given up" not in caplog.text
    background._WORLD.set()  # now as if the world its saves were made over was destroyed
    background.start_writer().put(lambda: time.sleep(1.0))
    with caplog.at_level("INFO"):
        background.finish_at_exit()
    assert background.given_up() and "with the process group destroyed" in caplog.text


MID_WRITE = textwrap.dedent(
    """
    import logging, sys
    import torch
    from torch import nn
    import sdadapt

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model = nn.Module()
    for i in range(16):
        model.register_parameter(f"p{i}", nn.Parameter(torch.randn(1024, 1024)))  # 64 MiB in all
    sdadapt.save_state(model, sys.argv[1], async_=True)  # and exit at once, the write just begun
    """
)


def test_a_save_given_up_mid_write_stops_before_the_interpreter_ends(tmp_path):
    """Exit gives up a save still writing its files (``SDADAPT_EXIT_WAIT_S=0``): the writing
    thread stops at its next file write, so the process exits 0 (a thread still inside torch's
    serialization as the interpreter finalizes aborts it: "terminate called"), and the folder
    is not a complete checkpoint."""
    script = tmp_path / "save.py"
    script.write_text(MID_WRITE)
    cut = tmp_path / "cut"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC_DIR), str(TESTS_DIR)]), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path), "PYTHONFAULTHANDLER": "1", "SDADAPT_EXIT_WAIT_S": "0"}  # fmt: skip
    run = subprocess.run([sys.executable, str(script), str(cut)], env=env, capture_output=True, text=True, timeout=240)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "terminate called" not in out, out[-3000:]
    assert f"the save to {cut} in the background did not end 0 s after" in out and "given up and" in out, out[-3000:]
    assert not complete(str(cut)) and not (cut / ".metadata").exists()


def test_ctrl_c_while_exit_waits_gives_the_save_up(monkeypatch, caplog):
    """Ctrl-C while exit waits without limit (``SDADAPT_EXIT_WAIT_S=inf``) gives the save up at
    once (its thread then stops at its next file write), logged, rather than leaving the thread
    running into the interpreter's end."""
    import signal

    monkeypatch.setenv("SDADAPT_EXIT_WAIT_S", "inf")
    monkeypatch.setattr(background, "_GIVEN_UP", threading.Event())
    # Ctrl-C raises KeyboardInterrupt also where the suite was started with SIGINT ignored (a
    # shell's background job, whose Python then leaves it ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    release = threading.Event()

    def writing() -> None:
        """A save still writing until it is given up (as a real one stops at its next file
        write), or the test ends: Ctrl-C comes while exit waits for it, however late a loaded
        machine runs the timer."""
        while not background.given_up() and not release.wait(0.01):
            pass

    background.start_writer().put(writing)
    backstop = threading.Timer(60, release.set)  # a Ctrl-C that never came fails the test, never hangs it
    backstop.start()
    main = threading.get_ident()
    threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
    try:
        with caplog.at_level("INFO"):
            background.finish_at_exit()
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while exit waited for a background save escaped finish_at_exit")
    finally:
        release.set()
        backstop.cancel()
        signal.signal(signal.SIGINT, previous)
    assert background.given_up() and "in the background was interrupted" in caplog.text and "given up and" in caplog.text
