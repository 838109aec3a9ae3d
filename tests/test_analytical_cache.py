"""The cache on disk of the analytical predictor's reduced workloads (predictors/
_workload_cache.py): a later process reads them back instead of building them, with the
same report; an entry is used only while every module file it was built with is unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from stg.predictors import _workload_cache as cache

# Predicts GPT-3 175B on 1,024 GPUs from options in a fresh process; prints the report and
# whether the core's lowering (which builds workloads) was imported.
PREDICT = """
import json, sys
from stg.api import GenerateOptions
from stg.host.registry import load_registry
from stg.predictors.analytical import predict_options
options = GenerateOptions(model="gpt", dmodel=12288, dff=49152, head=96, kvhead=96,
    num_stacks=96, seq=2048, dvocal=51200, tp=8, pp=16, dp=8, micro_batch=8, batch=1536)
report = predict_options(options, "a100-80g", registry=load_registry(autoload=False))
print(json.dumps({"report": report, "built": "stg.core.lowering" in sys.modules}))
"""


def predict_in_a_new_process(folder: Path) -> dict[str, object]:
    env = {**os.environ, cache.CACHE_ENV: str(folder)}
    done = subprocess.run(
        [sys.executable, "-c", PREDICT], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_later_process_reads_the_reduced_workloads_back(tmp_path: Path) -> None:
    first = predict_in_a_new_process(tmp_path)
    second = predict_in_a_new_process(tmp_path)
    assert first["built"] and not second["built"]
    assert second["report"] == first["report"]  # floats and all, through JSON's repr
    # 1 and 2 layers, and the model's count of block kinds
    assert len(list((tmp_path / cache.SUBFOLDER).glob("*.pickle"))) == 3


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    return tmp_path / cache.SUBFOLDER


@pytest.fixture
def source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A loaded module's file, which an entry stored now depends on."""
    path = tmp_path / "fake_model_source.py"
    path.write_text("LAYERS = 1\n")
    module = types.ModuleType("fake_model_source")
    module.__file__ = str(path)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return path


def test_an_entry_is_dropped_when_a_module_it_was_built_with_changes(
    folder: Path, source: Path
) -> None:
    key = cache.entry_key("options", [])
    cache.store(key, {"layers": 1})
    assert cache.load(key) == {"layers": 1}
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # same size
    assert cache.load(key) is None
    cache.store(key, {"layers": 1})
    source.write_text("LAYERS = 22\n")
    assert cache.load(key) is None
    cache.store(key, {"layers": 1})
    source.unlink()
    assert cache.load(key) is None


def test_the_key_holds_the_options_and_the_plugins() -> None:
    plugin = ("stg_int8_kernels", "stg-int8-kernels", "0.1.0", "entry point")
    keys = {
        cache.entry_key("options", []),
        cache.entry_key("other options", []),
        cache.entry_key("options", [plugin]),
        cache.entry_key("options", [(*plugin[:2], "0.2.0", plugin[3])]),
    }
    assert len(keys) == 4
    assert cache.entry_key("options", [plugin]) == cache.entry_key("options", [plugin])


def test_another_installation_keeps_its_own_entries(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another checkout or environment of stg sharing the folder neither reads nor replaces
    this one's entries (each entry's module files are those of the installation that stored
    it, unchanged though another one's code differs)."""
    here = cache.INSTALLATION
    key = cache.entry_key("options", [])
    cache.store(key, "built here")
    monkeypatch.setattr(cache, "INSTALLATION", "/elsewhere/stg/predictors")
    other = cache.entry_key("options", [])
    assert other != key and cache.load(other) is None
    assert cache.cached(other, lambda: "built there") == "built there"
    monkeypatch.setattr(cache, "INSTALLATION", here)
    assert cache.load(key) == "built here"


def test_a_broken_entry_is_built_again(folder: Path) -> None:
    key = cache.entry_key("options", [])
    folder.mkdir(parents=True)
    (folder / f"{key}.pickle").write_bytes(b"not a pickle")
    assert cache.cached(key, lambda: [1, 2]) == [1, 2]
    assert cache.load(key) == [1, 2]


def test_the_entries_a_process_stores_share_one_pickled_manifest(folder: Path) -> None:
    """The module files are pickled once for every entry a process stores (format 2); an
    entry of the earlier layout (the manifest inline, format 1) is a miss."""
    import pickle

    keys = [cache.entry_key(f"options {i}", []) for i in range(2)]
    for i, key in enumerate(keys):
        cache.store(key, {"layers": i})
    entries = [pickle.loads((folder / f"{key}.pickle").read_bytes()) for key in keys]
    assert [e[0] for e in entries] == [cache.FORMAT, cache.FORMAT] == [2, 2]
    assert entries[0][1] == entries[1][1]
    assert pickle.loads(entries[0][1]) == cache.loaded_files()
    assert [cache.load(key) for key in keys] == [{"layers": 0}, {"layers": 1}]
    old = (1, cache.loaded_files(), pickle.dumps({"layers": 0}))
    (folder / f"{keys[0]}.pickle").write_bytes(pickle.dumps(old))
    assert cache.load(keys[0]) is None


def test_an_empty_folder_setting_turns_the_cache_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, "")
    monkeypatch.chdir(tmp_path)
    built = []
    for _ in range(2):
        cache.cached(cache.entry_key("options", []), lambda: built.append(1) or "workload")
    assert len(built) == 2 and not list(tmp_path.iterdir())


def test_a_folder_that_cannot_be_written_only_costs_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(cache.CACHE_ENV, str(blocker))  # its subfolder cannot be made
    assert cache.cached(cache.entry_key("options", []), lambda: "workload") == "workload"
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_the_oldest_entries_go_beyond_the_limit(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cache, "MAX_ENTRIES", 2)
    keys = [cache.entry_key(f"options {i}", []) for i in range(3)]
    for i, key in enumerate(keys[:2]):
        cache.store(key, i)
        os.utime(folder / f"{key}.pickle", ns=(i * 10**9, i * 10**9))  # stored long ago
    cache.store(keys[2], 2)
    assert sorted(p.stem for p in folder.glob("*.pickle")) == sorted(keys[1:])
    assert not list(folder.glob(".*.tmp"))


@pytest.mark.parametrize(
    "options",
    [
        dict(model="deepseek", num_stacks=4, pp=2, dp=2, batch=8, micro_batch=4),
        dict(model="moe", num_stacks=4, pp=2, ep=2, dp=2, batch=8, micro_batch=4),
        dict(model="bert", num_stacks=4, pp=2, batch=8, micro_batch=4, zero=3),
        dict(
            model="llama", num_stacks=4, pp=2, tp=2, batch=8, micro_batch=4,
            activation_recompute="full", recompute_method="uniform", recompute_num_layers=1,
        ),
    ],
    ids=["deepseek", "moe-ep", "bert-zero3", "llama-recompute-method"],
)  # fmt: skip
def test_a_report_from_workloads_read_back_is_the_same(
    options: dict[str, object], folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stg.api
    from stg.host.registry import load_registry
    from stg.predictors import analytical

    build = stg.api.build_workload
    built: list[object] = []
    monkeypatch.setattr(stg.api, "build_workload", lambda *a: built.append(1) or build(*a))
    models: list[object] = []  # the model is looked up (imported) for its stack only to build
    reports, builds, lookups = [], [], []
    for _ in range(2):
        # a new process: only the disk remembers, and the built-in models are not imported
        analytical._cached_build.cache_clear()
        cache._cached_layer_kinds.cache_clear()
        registry = load_registry(autoload=False)
        get = registry.models.get
        monkeypatch.setattr(registry.models, "get", lambda n, get=get: models.append(n) or get(n))
        reports.append(analytical.predict_options(options, "a100-80g", registry=registry))
        builds.append(len(built))
        lookups.append(len(models))
    assert builds[0] > 0 and builds[1] == builds[0]
    assert lookups[0] > 0 and lookups[1] == lookups[0]
    assert reports[1] == reports[0]


def test_the_default_folder_is_the_users_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/cache")
    assert cache.cache_folder() == Path("/somewhere/cache/stg/reduced-workloads")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/home/someone")
    assert cache.cache_folder() == Path("/home/someone/.cache/stg/reduced-workloads")
    monkeypatch.setattr(os.path, "expanduser", lambda path: path)  # no home folder known
    assert cache.cache_folder() is None


def test_an_imported_model_counts_its_block_kinds_without_an_entry(folder: Path) -> None:
    from stg.api import GenerateOptions
    from stg.host.registry import load_registry
    from stg.predictors import analytical

    registry = load_registry(autoload=False)
    registry.models.get("deepseek")  # imported, as in a search after its first plan
    cache._cached_layer_kinds.cache_clear()
    options = GenerateOptions(model="deepseek", num_stacks=4, dense_layers=1, batch=8)
    assert analytical.unlike_layers(options, registry)  # dense and MoE layers
    assert not list(folder.glob("*.pickle"))  # none per plan of a search


def test_pruning_waits_for_an_eighth_more_than_the_limit(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store prunes the folder only once it holds MAX_ENTRIES + MAX_ENTRIES // 8 entries
    and more (a search stores dozens of entries; listing the folder each time cost more
    than the stores), then down to the MAX_ENTRIES newest."""
    monkeypatch.setattr(cache, "MAX_ENTRIES", 8)
    keys = [cache.entry_key(f"options {i}", []) for i in range(10)]
    for i, key in enumerate(keys[:9]):
        cache.store(key, i)
        os.utime(folder / f"{key}.pickle", ns=(i * 10**9, i * 10**9))
    assert len(list(folder.glob("*.pickle"))) == 9
    cache.store(keys[9], 9)
    assert sorted(p.stem for p in folder.glob("*.pickle")) == sorted(keys[2:])


def test_the_manifest_is_found_again_once_a_module_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = cache.loaded_files()
    assert cache.loaded_files() is first  # nothing loaded since: not listed again
    (tmp_path / "stg_cache_probe_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "stg_cache_probe_module", raising=False)
    __import__("stg_cache_probe_module")
    again = cache.loaded_files()
    assert any(path.endswith("stg_cache_probe_module.py") for path, _, _ in again)
    assert not any(path.endswith("stg_cache_probe_module.py") for path, _, _ in first)
