"""The `featcache` command's allocator setting (featcache/memory.py): kept by the commands that train, not by the
others."""

from featcache.cli import keeps_freed_memory


def test_only_the_training_commands_keep_freed_memory():
    for command in ("train", "grid", "search", "reproduce", "flower"):
        assert keeps_freed_memory(["featcache", command, "--seeds", "1"])
    for command in ("extract", "info", "gc", "verify", "migrate", "algos", "report", "plot", "datasets"):
        assert not keeps_freed_memory(["featcache", command, "--out", "cache"])
    assert not keeps_freed_memory(["featcache", "--json", "extract"])  # the first word that is no option
    assert keeps_freed_memory(["bench/search.py", "--quick"])  # a script that imports featcache.cli
    assert keeps_freed_memory(["featcache"])
