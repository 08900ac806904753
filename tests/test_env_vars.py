"""``OLV_*`` environment variables set to a value outside their accepted set raise
EnvironmentVariableError naming the variable, the value and the accepted values where the
variable is first used (not silently the default)."""
from __future__ import annotations

import pytest

from olv_runtime.structs import compiled
from olv_runtime.errors import EnvironmentVariableError
from olv_runtime.kernels import arena, packed_i8, precompile


@pytest.mark.parametrize("value", ["garbage", "AVX2x", "avx512"])
def test_olv_isa(monkeypatch, value):
    monkeypatch.setitem(packed_i8._ISA, "forced", None)
    monkeypatch.setitem(packed_i8._ISA, "env", value)
    with pytest.raises(EnvironmentVariableError, match=rf"OLV_ISA='{value}'.*'avx2'"):
        packed_i8.isa()
    # set_isa still takes precedence (the environment is only the default)
    monkeypatch.setitem(packed_i8._ISA, "forced", "avx2")
    assert packed_i8.isa() == "avx2"


def test_olv_isa_accepted_values(monkeypatch):
    monkeypatch.setitem(packed_i8._ISA, "forced", None)
    for value in (None, "avx2"):
        monkeypatch.setitem(packed_i8._ISA, "env", value)
        packed_i8.isa()
    monkeypatch.setitem(packed_i8._ISA, "env", "avx512vnni")
    if packed_i8.HOST_VNNI:
        assert packed_i8.isa() == "avx512vnni"
    else:
        with pytest.raises(EnvironmentVariableError, match="this one has not"):
            packed_i8.isa()


@pytest.mark.parametrize("value", ["garbage", "-1", "2", "off"])
def test_olv_weight_arena(monkeypatch, value):
    monkeypatch.setenv("OLV_WEIGHT_ARENA", value)
    with pytest.raises(EnvironmentVariableError, match=rf"OLV_WEIGHT_ARENA='{value}'.*'0'"):
        arena.weight_empty((8,), "float32")  # small: the variable is still checked


def test_olv_weight_arena_accepted(monkeypatch):
    for value, on in (("0", False), ("1", True), ("", True)):
        monkeypatch.setenv("OLV_WEIGHT_ARENA", value)
        assert arena._enabled() is on


@pytest.mark.parametrize("value", ["garbage", "-1", "1000", "2"])
def test_olv_compile_workers(monkeypatch, value):
    monkeypatch.setenv("OLV_COMPILE_WORKERS", value)
    with pytest.raises(EnvironmentVariableError, match=rf"OLV_COMPILE_WORKERS='{value}'.*'auto'"):
        precompile.enabled()


def test_olv_compile_workers_accepted(monkeypatch):
    monkeypatch.setenv("OLV_COMPILE_WORKERS", "0")
    assert precompile.enabled() is False
    monkeypatch.setenv("OLV_COMPILE_WORKERS", "1")
    assert precompile.enabled() is True
    for value in ("", "auto"):
        monkeypatch.setenv("OLV_COMPILE_WORKERS", value)
        assert precompile.enabled() in (True, False)


def test_olv_verify_digests(monkeypatch):
    monkeypatch.setenv("OLV_VERIFY_DIGESTS", "garbage")
    with pytest.raises(EnvironmentVariableError, match=r"OLV_VERIFY_DIGESTS='garbage'.*'full'"):
        compiled._cache_dir()
    monkeypatch.setenv("OLV_VERIFY_DIGESTS", "full")
    assert compiled._cache_dir() is None


def test_olv_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("OLV_VERIFY_DIGESTS", raising=False)
    monkeypatch.setenv("OLV_CACHE_DIR", "/dev/null/x")
    with pytest.raises(EnvironmentVariableError,
                       match=r"OLV_CACHE_DIR='/dev/null/x'.*'/dev/null' exists and is not a dir"):
        compiled._cache_dir()
    f = tmp_path / "file"
    f.write_text("")
    monkeypatch.setenv("OLV_CACHE_DIR", str(f / "a" / "b"))
    with pytest.raises(EnvironmentVariableError, match="is not a directory"):
        compiled._cache_dir()
    monkeypatch.setenv("OLV_CACHE_DIR", str(tmp_path / "new" / "dir"))
    assert compiled._cache_dir() == tmp_path / "new" / "dir" / "verified-digests"
