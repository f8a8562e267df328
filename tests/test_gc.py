"""`featcache gc` and `featcache migrate` remove or change only what featcache made, proved by its marker: the root
attribute of a store (`featcache_store`) or a cache (`featcache_format`), the marker file `featcache.json` of a folder
it stages work in. Explored over random folder contents (Hypothesis): featcache's stores (good, damaged, made by other
library versions, truncated), client caches of both formats, a user's HDF5 and text files named `.h5`, symbolic links
into and out of the folder, FIFOs, folders named `x.h5`, user folders named like a parts or staging folder, parts
folders with and without the marker. The property: every file featcache did not make is there afterwards with the
same bytes (a link with the same target), and a damaged store is moved aside, not deleted.

Stores are written by the store's own fill (`Store.plan` / `commit`) with a made-up identity and a few rows, no
backbone; the end-to-end cases (store paths with spaces, non-ASCII letters, links, store = out) run `extract` and
are marked slow."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from harness import BACKBONES, copy_store, damage_store, folder_extract_args, lines, one_line_error, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from featcache import cache as C
from featcache.errors import UserError
from featcache import files as F
from featcache.cache.identity import EMBEDDING_CODE, code_identity, content_key, versions
from featcache.extraction.store import Store, rows_folder, store_path
from featcache.extraction.stores import gc, verify as verify_store
from tests.synthetic import write_cache

# -- files featcache makes, and files a user makes -----------------------------------------------------------------


def make_store(folder: Path, name: str = "bb", other_versions: bool = False, rows: int = 5) -> Path:
    """A store of `rows` made-up 4-d embeddings, filled as extract fills one (plan, a finished block, commit)."""
    now = versions() | ({"torch": "0.0.0"} if other_versions else {})
    identity = {
        "dataset": {"name": "fake"},
        "code": code_identity(EMBEDDING_CODE)["sha256"],
        "versions": now,
        "backbone": {"name": name},
    }
    key = content_key(identity)
    store = Store(store_path(folder, "fake", name, key), key)
    need, index = ("d1", "train", 0), np.arange(rows) * 3
    with F.locked(store.work):
        (block,) = store.plan([(need, index)])
        with F.npy_file(block, (rows, 4)) as fh:
            fh.write(np.random.default_rng(rows).standard_normal((rows, 4), dtype=np.float32).tobytes())
        (store.work / "meta.json").write_text(
            json.dumps(
                {"key": name, "name": name, "weights": "random", "weights_sha256": "", "dim": 4, "preprocessing": {}}
            )
        )
        store.commit(identity)
        F.remove_own(store.work)
    return store.path


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> dict[str, Path]:
    """One file of each kind, copied into each example's folder."""
    from test_cache_format import format2_copy

    root = tmp_path_factory.mktemp("templates")
    made = {"store": make_store(root / "good"), "stale": make_store(root / "stale", other_versions=True)}
    made["damaged"] = copy_store(made["store"], root / "damaged.h5")
    damage_store(made["damaged"])
    made["truncated"] = root / "truncated.h5"
    made["truncated"].write_bytes(made["store"].read_bytes()[:1500])
    made["cache"] = Path(write_cache(root / "cache.h5", C=2, D=4, n=(3, 5)))
    (root / "f2").mkdir()
    made["format2"] = format2_copy(root / "f2")[1]
    made["foreign"] = root / "foreign.h5"
    with h5py.File(made["foreign"], "w") as f:
        f["x"] = np.arange(10)
        f.attrs["owner"] = "me"
    made["text"] = root / "text.h5"
    made["text"].write_text("my notes\n")
    return made


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path below `root` (hidden ones too), never following a link: a file's sha256, a link's target, a folder,
    or another kind (a FIFO)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            mode = os.lstat(p).st_mode
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(mode):
                out[rel] = ("dir",)
            elif stat.S_ISREG(mode):
                out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
            else:
                out[rel] = ("other",)
    return out


# -- gc over random folders ------------------------------------------------------------------------------------------

STORES = ("store", "stale", "damaged")  # featcache's stores gc checks
KINDS = (
    *STORES,
    "truncated",
    "cache",
    "format2",
    "foreign",
    "text",
    "folder",
    "link_in",
    "link_out",
    "fifo",
    "user_parts",
    "user_parts_of_a_store",
    "own_parts_empty",
    "own_parts_planned",
    "user_quarantine",
)


def build(folder: Path, outside: Path, kinds: list[str], templates: dict[str, Path]) -> dict[str, str]:
    """Fill `folder` with one entry per kind; returns {relative path of the entry: kind}."""
    made: dict[str, str] = {}
    for i, kind in enumerate(kinds):
        if kind in templates:
            name = f"fake.bb{i}.{i:016x}.h5" if kind in (*STORES, "truncated") else f"{kind}{i}.h5"
            copy_store(templates[kind], folder / name)
            if rows_folder(folder / name).exists():
                made[rows_folder(folder / name).name] = kind
        elif kind == "folder":
            name = f"data{i}.h5"
            (folder / name).mkdir()
            (folder / name / "inside.h5").write_bytes(templates["store"].read_bytes())  # a store of the user's
        elif kind == "link_in":
            name = f"link{i}.h5"
            targets = sorted(p.name for p in folder.iterdir())
            os.symlink(targets[i % len(targets)] if targets else outside / "user.h5", folder / name)
        elif kind == "link_out":
            name = f"out{i}.h5"
            os.symlink(outside / ("damaged.h5" if i % 2 else "user.h5"), folder / name)
        elif kind == "fifo":
            name = f"pipe{i}.h5"
            os.mkfifo(folder / name)
        elif kind in ("user_parts", "user_parts_of_a_store"):
            stores = sorted(p.name for p in folder.glob("fake.*.h5"))
            target = stores[0] if kind == "user_parts_of_a_store" and stores else f"x{i}.h5"
            name = f".{target}.parts"
            if (folder / name).exists():
                continue
            (folder / name).mkdir()
            (folder / name / "keep.txt").write_text("mine\n")
            (folder / name / "plan.json").write_text("{}")
        elif kind in ("own_parts_empty", "own_parts_planned"):
            name = f".fake.gone{i}.{i:016x}.h5.parts"
            F.claim(folder / name, "parts")
            if kind == "own_parts_planned":
                (folder / name / "plan.json").write_text("[]")
        elif kind == "user_quarantine":
            name = ".quarantine"
            if (folder / name).exists():
                continue
            (folder / name).mkdir()
            (folder / name / "fake.bb0.0000000000000000.h5").write_text("a user's file in a folder of that name\n")
        made[name] = kind
    return made


@settings(max_examples=40)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=7), dry_run=st.booleans(), remove_damaged=st.booleans()
)
def test_gc_removes_nothing_featcache_did_not_make(templates, tmp_path, kinds, dry_run, remove_damaged):
    with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
        root = Path(tmp)
        folder, outside = root / "store", root / "outside"
        folder.mkdir()
        outside.mkdir()
        shutil.copy(templates["foreign"], outside / "user.h5")
        copy_store(templates["damaged"], outside / "damaged.h5")
        made = build(folder, outside, kinds, templates)
        before = snapshot(root)
        ours = {name for name, kind in made.items() if kind in (*STORES, "own_parts_empty", "own_parts_planned")}
        try:
            report = gc(folder, dry_run=dry_run, remove_damaged=remove_damaged)
        except UserError as e:
            assert "\n" not in str(e) and "nothing was removed" in str(e)
            assert not ours and snapshot(root) == before  # a folder with nothing of featcache's: untouched
            return
        after = snapshot(root)
        if dry_run:
            assert after == before
        quarantined = made.get(".quarantine") is None  # a user's .quarantine: damaged stores stay where they are
        for rel, value in before.items():
            top = rel.split("/")[1] if rel.startswith("store/") else None
            kind = made.get(top)
            if kind not in (*STORES, "own_parts_empty") or dry_run:
                assert after.get(rel) == value, (rel, kind)  # not featcache's, or kept: the same bytes
            elif kind == "stale" or kind == "own_parts_empty":
                assert rel not in after, rel  # made by featcache, used by no command: removed
            elif kind == "damaged":
                assert rel not in after or not quarantined, rel
                moved = f"store/.quarantine/{rel.split('/', 1)[1]}"  # a store's rows folder moves with it
                if not remove_damaged and quarantined:
                    assert after[moved] == value  # moved aside with every byte, not deleted
            else:
                assert after[rel] == value  # a good store stays as it was
        new = set(after) - set(before)
        assert all(p.startswith("store/.quarantine") for p in new), new
        left = {Path(e["file"]).name for e in report["left_alone"]}
        foreign = {name for name, kind in made.items() if name.endswith(".h5") and kind not in STORES}
        assert foreign <= left, foreign - left  # every foreign .h5 entry is listed as left alone
        assert all(e["reason"].endswith("left alone") or "left as it is" in e["reason"] for e in report["left_alone"])


def test_gc_on_a_folder_of_caches_or_user_data_says_so_and_removes_nothing(templates, tmp_path):
    caches = tmp_path / "cache"
    (caches / "store").mkdir(parents=True)
    shutil.copy(templates["cache"], caches / "a.h5")
    shutil.copy(templates["format2"], caches / "b.h5")
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(templates["foreign"], data / "x.h5")
    shutil.copy(templates["foreign"], data / "y.h5")
    before = snapshot(tmp_path)
    for target, needle in (
        (
            caches,
            f"holds client caches (2), not embedding stores: gc prunes a folder of stores "
            f"and never removes anything else; nothing was removed; pass the folder of the "
            f"stores ({caches / 'store'})",
        ),
        (data, "holds no featcache embedding store it can read (2 .h5 file(s) without a readable featcache marker)"),
    ):
        one_line_error(run_cli("gc", str(target)), needle)
        one_line_error(run_cli("gc", str(target), "--dry-run", "--json"), needle)
    assert snapshot(tmp_path) == before


def test_a_truncated_store_is_left_alone_as_unreadable_never_called_foreign(templates, tmp_path):
    """A store cut short starts as HDF5 but HDF5 cannot open it: its marker cannot be read, so gc leaves it alone
    and says so (it said the file was one featcache did not make)."""
    folder = tmp_path / "store"
    folder.mkdir()
    shutil.copy(templates["truncated"], folder / "cut.h5")
    before = snapshot(tmp_path)
    one_line_error(
        run_cli("gc", str(folder)),
        "1 .h5 file(s) without a readable featcache marker, 1 of them HDF5 files that HDF5 cannot open: truncated or "
        "damaged",
    )
    assert snapshot(tmp_path) == before
    good = make_store(folder)
    done = run_cli("gc", str(folder), "--json")
    assert done.code == 0, done.stderr
    (left,) = json.loads(done.stdout)["left_alone"]
    assert left["file"] == str(folder / "cut.h5") and "HDF5 cannot open (truncated or damaged)" in left["reason"]
    assert "not featcache's" not in left["reason"] and json.loads(done.stdout)["kept"] == [{"file": str(good)}]
    assert (folder / "cut.h5").read_bytes() == templates["truncated"].read_bytes()


def test_gc_lists_foreign_files_as_left_alone_in_its_table_and_json(templates, tmp_path):
    folder = tmp_path / "store"
    folder.mkdir()
    good = make_store(folder)
    shutil.copy(templates["foreign"], folder / "mine.h5")
    (folder / "notes.h5").write_text("notes\n")
    os.symlink(templates["foreign"], folder / "x.h5")
    (folder / ".x.h5.parts").mkdir()
    (folder / ".x.h5.parts" / "keep.txt").write_text("mine\n")
    before = snapshot(tmp_path)
    for args in (["--dry-run", "--json"], ["--json"]):
        done = run_cli("gc", str(folder), *args)
        assert done.code == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["removed"] == report["quarantined"] == [] and report["kept"] == [{"file": str(good)}]
        reasons = {Path(e["file"]).name: e["reason"] for e in report["left_alone"]}
        assert set(reasons) == {"mine.h5", "notes.h5", "x.h5", ".x.h5.parts"}
        assert "not featcache's" in reasons["mine.h5"] and "symbolic link" in reasons["x.h5"]
        assert "not featcache's" in reasons[".x.h5.parts"]
    table = run_cli("gc", str(folder))
    assert table.code == 0 and table.stdout.count("left alone") >= 4 and "removed" not in table.stdout
    assert snapshot(tmp_path) == before


def test_a_damaged_store_that_cannot_be_moved_is_left_as_it_is_in_one_row(templates, tmp_path, monkeypatch):
    """What an immutable store (chattr +i) gives the rename: EPERM; gc says so and exits 0, the file unchanged."""
    folder = tmp_path / "store"
    folder.mkdir()
    bad = copy_store(templates["damaged"], folder / templates["store"].name)
    real = os.rename

    def refuse(src, dst):
        if Path(src) == bad:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(src))
        return real(src, dst)

    monkeypatch.setattr(os, "rename", refuse)
    before = bad.read_bytes()
    done = run_cli("gc", str(folder), "--json")
    assert done.code == 0, done.stderr
    (entry,) = json.loads(done.stdout)["left_alone"]
    assert entry["file"] == str(bad) and "could not move it aside (Operation not permitted)" in entry["reason"]
    assert bad.read_bytes() == before


def test_gc_names_duplicates_and_removes_only_the_one_made_by_other_versions(tmp_path):
    folder = tmp_path / "store"
    good, old = make_store(folder), make_store(folder, other_versions=True)  # the same rows under two keys
    report = json.loads(run_cli("gc", str(folder), "--json").stdout)
    assert report["duplicates"] == [[str(good), str(old)]] and report["kept"] == [{"file": str(good)}]
    (removed,) = report["removed"]
    assert removed["file"] == str(old) and removed["reason"] == (
        f"made with other library versions (the same embeddings as {good.name})"
    )
    assert not old.exists() and good.exists()


def test_gc_removes_a_parts_folder_only_under_featcache_marker_and_never_a_held_one(tmp_path):
    folder = tmp_path / "store"
    empty, held = folder / ".fake.a.0000000000000000.h5.parts", folder / ".fake.b.0000000000000000.h5.parts"
    make_store(folder)
    F.claim(empty, "parts")
    done = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with F.locked(held):
            done.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    done.wait(30)
    try:
        report = gc(folder)
    finally:
        release.set()
        holder.join(30)
    assert [e["file"] for e in report["removed"]] == [str(empty)] and not empty.exists() and held.exists()


def test_gc_cleans_a_folder_left_half_removed_by_a_kill(tmp_path):
    folder = tmp_path / "store"
    make_store(folder)
    work = folder / ".fake.a.0000000000000000.h5.parts"
    F.claim(work, "parts")
    gone = work.with_name(work.name + ".1234abcd.gone")
    os.rename(work, gone)  # what remove_own leaves when killed between its rename and its rmtree
    report = gc(folder)
    assert [e["file"] for e in report["removed"]] == [str(gone)] and not gone.exists()


# -- staging folders: claimed with the marker, a user's refused ----------------------------------------------------


@pytest.mark.parametrize("obstacle", ["folder", "file", "link", "fifo"])
def test_a_users_entry_named_like_a_staging_folder_is_refused_and_left_as_it_is(tmp_path, obstacle):
    work = tmp_path / ".c.h5.migrating"
    if obstacle == "folder":
        work.mkdir()
        (work / "c.h5").write_text("mine\n")
    elif obstacle == "file":
        work.write_text("mine\n")
    elif obstacle == "link":
        (tmp_path / "elsewhere").mkdir()
        os.symlink(tmp_path / "elsewhere", work)
    else:
        os.mkfifo(work)
    before = snapshot(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(UserError, match="is in the way: featcache stages a cache's migration") as e:
        with F.locked(work, "migrating"):
            pass
    assert time.monotonic() - t0 < F.CLAIM_WAIT and "\n" not in str(e.value)  # refused at once, no wait
    assert snapshot(tmp_path) == before


def test_an_empty_unmarked_folder_gets_a_bounded_wait_then_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(F, "CLAIM_WAIT", 0.2)
    work = tmp_path / ".x.h5.parts"
    work.mkdir()
    with pytest.raises(UserError, match="not featcache's"):
        F.claim(work, "parts")
    assert work.is_dir() and not any(work.iterdir())


def test_claimers_at_once_all_find_the_folder_featcache_made(tmp_path):
    work = tmp_path / "deep" / ".s.h5.parts"
    start, errors = threading.Barrier(4), []

    def claim() -> None:
        start.wait()
        try:
            with F.locked(work):
                pass
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and F.own(work, "parts") is not None


def test_a_claimer_that_looks_before_the_marker_and_scans_after_the_lock_finds_the_folder_featcache_made(
    tmp_path, monkeypatch
):
    """The interleaving two migrates met: the first look sees no marker yet, the scan sees the marker and the lock
    file (its maker has since claimed and locked it): the folder is featcache's, not a user's in the way."""
    work = tmp_path / ".c.h5.migrating"
    with F.locked(work, "migrating"):
        own, looks = F.own, []

        def late_own(folder, kind=None):
            looks.append(folder)
            return None if len(looks) == 1 else own(folder, kind)

        monkeypatch.setattr(F, "own", late_own)
        F.claim(work, "migrating")
    assert len(looks) == 2


# -- migrate over random neighbourhoods ----------------------------------------------------------------------------

TARGETS = ("format2", "cache", "store", "foreign", "text")
OBSTACLES = (None, "folder", "file", "link")


@settings(max_examples=20)
@given(
    target=st.sampled_from(TARGETS),
    links=st.integers(0, 2),
    obstacle=st.sampled_from(OBSTACLES),
    neighbours=st.lists(st.sampled_from(("foreign", "text", "cache")), max_size=3),
)
def test_migrate_changes_nothing_but_the_cache_it_converts(templates, tmp_path, target, links, obstacle, neighbours):
    with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
        root = Path(tmp)
        real_dir, link_dir = root / "real", root / "links"
        real_dir.mkdir()
        link_dir.mkdir()
        real = Path(shutil.copy(templates[target], real_dir / "c.h5"))
        for i, kind in enumerate(neighbours):
            shutil.copy(templates[kind], real_dir / f"n{i}.h5")
        path = real
        for i in range(links):  # a chain of links, in another folder
            os.symlink(path, link_dir / f"l{i}.h5")
            path = link_dir / f"l{i}.h5"
        work = real_dir / ".c.h5.migrating"
        if obstacle == "folder":
            work.mkdir()
            (work / "c.h5").write_text("a user's file\n")
        elif obstacle == "file":
            work.write_text("a user's file\n")
        elif obstacle == "link":
            os.symlink(root / "links", work)
        before = snapshot(root)
        try:
            result = C.migrate(path)
        except UserError as e:
            assert "\n" not in str(e)
            assert snapshot(root) == before  # refused: nothing changed, the user's folder included
            assert target != "format2" or obstacle is not None
            return
        assert target == "format2" and obstacle is None and result["path"] == str(path)
        after = snapshot(root)
        changed = {rel for rel in set(before) | set(after) if before.get(rel) != after.get(rel)}
        assert changed == {"real/c.h5"}  # the real file, converted; every link and neighbour as it was
        assert C.verify(real)["ok"] and C.verify(path)["ok"]
        with h5py.File(real, "r") as f:
            assert f.attrs["featcache_format"] == C.FORMAT


# -- info and verify on folders and files of every kind --------------------------------------------------------------


def test_info_on_a_folder_of_caches_describes_caches_and_never_advises_gc(templates, tmp_path):
    folder = tmp_path / "cache"
    (folder / "store").mkdir(parents=True)
    shutil.copy(templates["cache"], folder / "a.h5")
    shown = run_cli("info", str(folder))
    line = one_line_error(shown, "holds client caches (1), not embedding stores")
    assert "damaged" not in line and "gc" not in line and str(folder / "a.h5") in line and str(folder / "store") in line
    assert run_cli("info", str(folder / "a.h5")).code == 0  # the cache itself: its metadata


def test_verify_and_info_tell_a_store_from_a_cache_in_one_folder(templates, tmp_path):
    folder = tmp_path / "out"
    store = make_store(folder)
    cache = Path(shutil.copy(templates["cache"], folder / "fake-0123456789abcdef.h5"))
    for target in (store, cache):
        done = run_cli("verify", str(target), "--json")
        assert done.code == 0 and json.loads(done.stdout)["ok"], done.stdout
    listed = json.loads(run_cli("info", str(folder), "--json").stdout)
    assert [s["file"] for s in listed["stores"]] == [str(store)]
    gone = json.loads(run_cli("gc", str(folder), "--json").stdout)
    assert gone["kept"] == [{"file": str(store)}] and [e["file"] for e in gone["left_alone"]] == [str(cache)]


def test_verify_of_a_store_names_each_problem(templates, tmp_path):
    bad = copy_store(templates["damaged"], tmp_path / templates["store"].name)
    report = verify_store(bad)
    assert not report["ok"] and "crc32" in report["problems"][0]
    renamed = copy_store(templates["store"], tmp_path / "fake.bb.ffffffffffffffff.h5")
    assert "its name says key ffffffffffffffff" in verify_store(renamed)["problems"][0]
    stale = verify_store(templates["stale"])
    assert stale["ok"] and any(line.startswith("torch 0.0.0") for line in stale["stale"])
    line = one_line_error(run_cli("verify", str(bad)), "crc32")
    assert str(bad) in line


# -- stores made wherever --store points verify, and gc keeps them ---------------------------------------------------

NAMES = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"), min_size=1, max_size=12)


@settings(max_examples=25)
@given(name=NAMES.filter(lambda n: n not in (".", "..")), linked=st.booleans(), with_cache=st.booleans())
def test_a_store_filled_under_any_folder_name_verifies_and_gc_keeps_it(templates, tmp_path, name, linked, with_cache):
    with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
        folder = Path(tmp) / name
        folder.mkdir()
        if linked:  # filled and checked through a link to the folder
            os.symlink(folder, Path(tmp) / "link")
            folder = Path(tmp) / "link"
        store = make_store(folder)
        if with_cache:  # --store = --out: the caches beside the stores
            shutil.copy(templates["cache"], folder / "fake-0123456789abcdef.h5")
        assert verify_store(store)["ok"], verify_store(store)["problems"]
        report = gc(folder)
        assert report["kept"] == [{"file": str(store)}] and report["removed"] == report["quarantined"] == []
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            [store.name, f"{store.name}.rows", *(["fake-0123456789abcdef.h5"] if with_cache else [])]
        )


# -- the same, through `extract` ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("case", ["spaces and non-ASCII", "linked store folder", "store = out", "linked out"])
def test_stores_made_under_any_store_path_verify_and_gc_keeps_them(images, tmp_path, case):
    out = tmp_path / ("ö ut" if case == "spaces and non-ASCII" else "out")
    store = {"spaces and non-ASCII": tmp_path / "st ö re", "store = out": out}.get(case)
    if case == "linked store folder":
        (tmp_path / "real store").mkdir()
        os.symlink(tmp_path / "real store", tmp_path / "store link")
        store = tmp_path / "store link"
    if case == "linked out":
        (tmp_path / "real out").mkdir()
        os.symlink(tmp_path / "real out", out)
    args = folder_extract_args(
        images,
        out,
        "--partition",
        "iid",
        "--domains",
        "d1",
        "--clients",
        "2",
        *(["--store", str(store)] if store else []),
    )
    first = run_cli(*args)
    assert first.code == 0, first.stderr
    folder = store or out / "store"
    stores = sorted(folder.glob("*.*.*.h5"))
    assert len(stores) == len(BACKBONES)
    cache = json.loads(first.stdout)["cache"]
    for target in (cache, *stores):
        checked = run_cli("verify", str(target))
        assert checked.code == 0 and checked.stdout.startswith("ok:"), (target, checked.stderr)
    before = snapshot(tmp_path / "real store" if case == "linked store folder" else folder)
    report = json.loads(run_cli("gc", str(folder), "--json").stdout)
    assert sorted(k["file"] for k in report["kept"]) == sorted(map(str, stores))
    assert report["removed"] == report["quarantined"] == []
    assert snapshot(tmp_path / "real store" if case == "linked store folder" else folder) == before
    again = run_cli(*args)
    assert again.code == 0 and json.loads(again.stdout)["cache_hit"]


@pytest.mark.slow
def test_extract_refuses_a_users_folder_named_like_a_parts_folder_and_leaves_it(images, tmp_path):
    out = tmp_path / "out"
    base = folder_extract_args(images, out, "--partition", "iid", "--domains", "d1")
    first = run_cli(*base, "--clients", "2")
    assert first.code == 0, first.stderr
    store = sorted((out / "store").glob("*.*.*.h5"))[0]
    mine = store.with_name(f".{store.name}.parts")
    mine.mkdir()
    (mine / "keep.txt").write_text("mine\n")
    hit = run_cli(*base, "--clients", "2")  # a cache hit: the leftover sweep leaves a user's folder alone
    assert hit.code == 0 and (mine / "keep.txt").read_text() == "mine\n"
    store.unlink()  # the next run must fill it again, through the folder of that name
    before = snapshot(out)
    refused = run_cli(*base, "--clients", "3")
    line = one_line_error(refused, "is in the way")
    assert (
        str(mine) in line and "move or rename it" in line and not [x for x in lines(refused.stderr) if "Traceback" in x]
    )
    assert snapshot(out) == before and sorted(p.name for p in mine.iterdir()) == ["keep.txt"]
