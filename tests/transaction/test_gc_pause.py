"""The cycle collector is paused for the length of a load (sdadapt._base.gc) and turned back on after
it, also when the load fails; pauses nest."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

import sdadapt
from sdadapt._base import gc as _gc
from sdadapt._base.gc import gc_paused
from sdadapt._transaction import steps as _steps


def test_pauses_nest_and_restore_the_collector_even_on_errors():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block found it off and leaves it off
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before: stays off
    finally:
        gc.enable()


def test_load_plans_and_reads_with_the_collector_paused(tmp_path, monkeypatch):
    seen: list[bool] = []
    real = _steps.build_plan

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(_steps, "build_plan", spy)
    model = torch.nn.Linear(4, 3)
    path = tmp_path / "w.safetensors"
    save_file({"weight": torch.randn(3, 4), "bias": torch.randn(3)}, str(path))
    sdadapt.load(model, str(path))
    assert seen == [False] and gc.isenabled()
    save_file({"weight": torch.randn(3, 4)}, str(path))  # bias missing: a plan error
    with pytest.raises(sdadapt.errors.PlanError, match="bias"):
        sdadapt.load(model, str(path))
    assert seen == [False, False] and gc.isenabled()


def test_a_public_name_imports_its_modules_with_the_collector_paused():
    """The first use of a public name imports its modules (``sdadapt._base.lazy``) with no
    collection inside, even where the collector's thresholds would run many; the collector is on
    again afterwards, and one the caller turned off stays off."""
    child = textwrap.dedent(
        """
        import gc, json, sys
        import sdadapt

        runs = []

        def importing():  # the load's module is being imported (its body or the modules it imports)
            module = sys.modules.get("sdadapt._load.loading")
            return module is not None and getattr(module.__spec__, "_initializing", False)

        gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "start" and importing() else None)
        gc.disable()
        rename = sdadapt.rename  # the rules and pydantic, imported while the caller has the collector off
        off_after = not gc.isenabled()
        gc.enable()
        gc.set_threshold(100)  # unpaused, importing the engine would run collections of every generation
        before = "sdadapt._engine.engine" in sys.modules
        load = sdadapt.load
        print(json.dumps({"runs": runs, "on": gc.isenabled(), "off_after": off_after, "before": before,
                          "imported": "sdadapt._engine.engine" in sys.modules, "rename": rename.__name__}))
        """
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"runs": [], "on": True, "off_after": True, "before": False, "imported": True, "rename": "rename"}, result


def test_a_first_load_leaves_a_full_collection_the_process_owes_to_the_caller(tmp_path):
    """A process that owes a full collection (its oldest generation grew by over a quarter since
    the last one, as building a model makes it) ran it inside its first ``sdadapt.load``: at
    the first allocation after the load turned the collector back on. The load now ends its pause
    with a collection of the youngest generation only, and its imports' pause with none (their
    objects moved to the oldest generation, which starts the generations' counts afresh): no full
    collection inside the call, and the one owed still runs in the caller's code, once the
    caller's allocations have run the oldest generation's count of middle collections again. A
    plain pause (``gc.disable()`` / ``gc.enable()``) shows the full one landing inside, so the
    process here does owe it."""
    child = textwrap.dedent(
        """
        import gc, json, sys
        import torch
        from safetensors.torch import save_file
        import sdadapt

        path, runs, inside, kept = sys.argv[1], [], [False], []
        save_file({"weight": torch.randn(3, 4), "bias": torch.randn(3)}, path)
        model = torch.nn.Linear(4, 3)

        def owe_a_full_collection():
            gc.collect()
            gc.disable()
            kept.append([[i] for i in range(len(gc.get_objects()) // 2)])  # long-lived, half the process again
            for _ in range(11):  # the oldest generation's threshold is 10 middle-generation collections
                gc.collect(1)
            gc.enable()

        gc.callbacks.append(lambda phase, info: runs.append((info["generation"], inside[0])) if phase == "start" else None)

        def within(call):
            runs.clear()
            owe_a_full_collection()
            runs.clear()
            inside[0] = True
            call()
            inside[0] = False
            after = [[i] for i in range(100_000)]  # the caller's next allocations: over 10 middle collections
            return {"inside": [g for g, i in runs if i], "after": [g for g, i in runs if not i]}

        def plain_pause():
            gc.disable()
            made = [[i] for i in range(3000)]
            gc.enable()
            return [made]

        out = {"plain": within(plain_pause), "load": within(lambda: sdadapt.load(model, path)), "on": gc.isenabled()}
        print(json.dumps(out))
        """
    )
    path = tmp_path / "w.safetensors"
    out = subprocess.run([sys.executable, "-c", child, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert 2 in result["plain"]["inside"], result  # the process owes it: a plain pause's end runs it
    assert 2 not in result["load"]["inside"], result
    assert 2 in result["load"]["after"], result  # not lost: the caller's code runs it
    assert result["load"]["inside"] and set(result["load"]["inside"]) == {0}, result
    assert result["on"], result


def test_a_pause_is_one_for_the_process_across_threads():
    """A background thread's pause (kvikio's import, started at a first load's end) that outlives
    the load's keeps the collector off until it ends too; the last to end turns it back on."""
    import threading

    from sdadapt._base.gc import pause, resume

    started, release = threading.Event(), threading.Event()

    def background():
        with gc_paused():
            started.set()
            release.wait(30)

    pause()
    thread = threading.Thread(target=background)
    thread.start()
    assert started.wait(30)
    resume()
    assert not gc.isenabled()  # the background pause is still on
    release.set()
    thread.join(30)
    assert gc.isenabled()


def _collections_in(block) -> list[int]:
    """The generations the collector ran while ``block()`` ran (its pause's end included)."""
    runs: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(info["generation"])

    gc.callbacks.append(record)
    try:
        block()
    finally:
        gc.callbacks.remove(record)
    return runs


@pytest.mark.skipif(
    not _gc._SPLICES,
    reason="needs CPython 3.13 or older with the GIL: on this Python gc.freeze() walks every object, "
    "so an import's pause ends with a young collection instead",
)
def test_an_imports_pause_ends_without_a_collection_and_its_objects_stay_collectable():
    """A pause for long-lived objects (an import) ends with no collection: what it made is in the
    oldest generation, the youngest's count starts afresh, nothing stays frozen, and a cycle made
    inside is still freed by a full collection. A plain pause nested in it, or objects the caller
    froze, give the youngest generation's collection instead (the caller's frozen ones stay so)."""
    gc.collect()
    made: list = []

    class Cycle:
        pass

    def importing(long_lived: bool = True) -> None:
        with gc_paused(long_lived=True):
            made.append([[i] for i in range(5000)])
            cycle = Cycle()
            cycle.me = cycle  # garbage once the block ends; only a collection frees it
            with gc_paused(long_lived=long_lived):
                made.append([[i] for i in range(10)])

    assert _collections_in(importing) == []
    assert gc.get_count()[0] < 100 and gc.get_freeze_count() == 0 and gc.isenabled()
    assert any(type(o) is Cycle for o in gc.get_objects(generation=2))
    gc.collect()
    assert not any(type(o) is Cycle for o in gc.get_objects())
    assert _collections_in(lambda: importing(long_lived=False)) == [0]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert _collections_in(importing) == [0] and gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
