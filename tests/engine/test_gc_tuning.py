"""gc_tuning: the first engine of a process freezes the start-up heap and raises the gen-0
threshold; only it undoes that, at shutdown (so engine after engine does not pile up frozen heaps)."""
import gc

import pytest

import pagedllm.engine.gc_tuning as gct


@pytest.fixture
def fresh(monkeypatch):
    """Module state as in a process where no engine has started; the collector's state restored after."""
    saved_owner, saved_th = gct._owner, gct._saved_threshold
    saved_gc = gc.get_threshold()
    monkeypatch.setattr(gct, "_owner", None)
    monkeypatch.setattr(gct, "_saved_threshold", None)
    gc.unfreeze()
    gc.set_threshold(*gct._PY_DEFAULT_THRESHOLD)
    yield
    if gct._owner is not None:
        gc.unfreeze()
    gc.set_threshold(*saved_gc)
    gct._owner, gct._saved_threshold = saved_owner, saved_th
    if saved_owner is not None:
        gc.freeze()  # NOTE: an engine of this test process had frozen its heap: keep it so


class Owner:
    pass


def test_first_engine_freezes_then_releases(fresh, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_GC_THRESHOLD", "5000")
    a, b = Owner(), Owner()
    keep = [[i] for i in range(1000)]  # tracked objects alive at "start-up"
    assert gct.freeze_startup_heap(a)
    assert gc.get_freeze_count() >= len(keep)
    assert gc.get_threshold() == (5000, 10, 10)
    assert gct.is_frozen_by(a) and not gct.is_frozen_by(b)
    assert not gct.freeze_startup_heap(b), "a second engine of the process does not freeze again"
    assert not gct.release_startup_heap(b), "only the engine that froze releases"
    assert gc.get_freeze_count() >= len(keep)
    assert gct.release_startup_heap(a)
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == gct._PY_DEFAULT_THRESHOLD
    assert not gct.release_startup_heap(a)
    assert gct.freeze_startup_heap(b), "after the release, the next engine may freeze"
    assert gct.release_startup_heap(b)


def test_off_and_user_thresholds(fresh, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_GC_FREEZE", "0")
    assert not gct.freeze_startup_heap(Owner())
    assert gc.get_freeze_count() == 0
    monkeypatch.setenv("PAGEDLLM_GC_FREEZE", "1")
    gc.set_threshold(1234, 5, 5)  # the process's own choice: kept
    o = Owner()
    assert gct.freeze_startup_heap(o)
    assert gc.get_threshold() == (1234, 5, 5)
    assert gct.release_startup_heap(o)
    assert gc.get_threshold() == (1234, 5, 5)
    monkeypatch.setenv("PAGEDLLM_GC_THRESHOLD", "0")  # 0: Python's thresholds stay
    gc.set_threshold(*gct._PY_DEFAULT_THRESHOLD)
    assert gct.freeze_startup_heap(o)
    assert gc.get_threshold() == gct._PY_DEFAULT_THRESHOLD
    assert gct.release_startup_heap(o)


def test_dropped_owner_releases(fresh):
    o = Owner()
    assert gct.freeze_startup_heap(o)
    del o  # freed by reference counting: the finalizer unfreezes
    assert gct._owner is None and gc.get_freeze_count() == 0
    assert gc.get_threshold() == gct._PY_DEFAULT_THRESHOLD


def test_collector_paused_restores_and_nests():
    was = gc.isenabled()
    gc.enable()
    try:
        with gct.collector_paused():
            assert not gc.isenabled()
            with gct.collector_paused():
                assert not gc.isenabled()
            assert not gc.isenabled(), "an inner pause leaves the outer one in force"
        assert gc.isenabled()
        with pytest.raises(RuntimeError):
            with gct.collector_paused():
                raise RuntimeError("construction failed")
        assert gc.isenabled(), "restored after an exception too"
        gc.disable()
        with gct.collector_paused():
            pass
        assert not gc.isenabled(), "a collector that was off stays off"
    finally:
        (gc.enable if was else gc.disable)()


class _Cycle:
    def __init__(self):
        self.me = self


def test_freeze_after_a_full_collection_collects_young_only(fresh):
    """After a full collection during construction, the freeze collects generations 0-1 (young
    cyclic garbage still goes) without walking the whole heap again; otherwise it runs a full one."""
    before = gct.full_collections()
    gc.collect()  # the worker's, after loading
    assert gct.full_collections() == before + 1
    young = _Cycle()
    ref = __import__("weakref").ref(young)
    del young
    o = Owner()
    assert gct.freeze_startup_heap(o, before)
    assert ref() is None, "the young cyclic garbage was collected before the freeze"
    assert gct.full_collections() == before + 1, "no second full collection"
    assert gct.release_startup_heap(o)
    n = gct.full_collections()
    assert gct.freeze_startup_heap(o, n), "no full collection since: a full one runs"
    assert gct.full_collections() == n + 1
    assert gct.release_startup_heap(o)
