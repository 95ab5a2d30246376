"""``cpu_ops.LazyExtension``: one build attempt per process, ``PAGEDLLM_CPU_KERNELS=0`` for the
optional modules only, the failure reported once (real builds of a source that does not compile)."""
from pagedllm.kernels import cpu_ops


def _bad_source(tmp_path):
    src = tmp_path / "broken.cpp"
    src.write_text("this is not C++;\n")
    return [str(src)]


def test_disabled_optional_module_is_never_built(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    errors = []
    ext = cpu_ops.LazyExtension(_bad_source(tmp_path), "pagedllm_test_broken", "a broken module",
                                on_error=errors.append)
    assert ext.built() is None
    assert ext.get() is None and ext.get() is None
    assert ext.tried and ext.error is None and errors == []
    assert not (tmp_path / "cache").exists()  # nothing compiled, nothing cached


def test_failed_build_is_tried_once_and_reported_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    # optional=False (batch-invariant kernels: no torch fallback): the switch does not apply.
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    errors = []
    ext = cpu_ops.LazyExtension(_bad_source(tmp_path), "pagedllm_test_broken", "a broken module",
                                optional=False, on_error=errors.append)
    assert ext.get() is None
    assert ext.get() is None  # no second build
    assert len(errors) == 1 and isinstance(errors[0], Exception)
    assert ext.error is not None and ext.error.startswith(type(errors[0]).__name__ + ": ")
    assert ext.tried and ext.built() is None
    assert not list((tmp_path / "cache").glob("*.so"))
