"""The Flower `ServerApp` and `ClientApp` of a featcache run (Flower's Message API; federation.py holds the logic).

Every message is one tree of tensors and JSON values (`federation.pack`, the checkpoint's codec): the memory its
tensors view as one `ArrayRecord` ("arrays"), its skeleton in a `ConfigRecord` ("tree"). A client keeps its state in
Flower's context state (`Context.state`, the same two records) between messages. What a run trains comes from the
apps' arguments or, where an argument is None, from the run config (`[tool.flwr.app.config]` of a `flwr run`
project): `algo`, `settings` (a JSON object of settings), `seed`, `rounds`, `out` (the folder for the result files;
"" writes none), `timeout` (seconds one exchange's replies may take) and `clients` (the nodes the server waits for;
0: those connected). A node's data comes from its node config: `cache` (a cache or a per-client file of `featcache
split`; else the run config's `cache`) and `client` (its index in a whole cache; in Flower's simulation
`partition-id`).
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from ..cache import split as cache_split
from ..errors import UserError
from ..runs.spec import RunSpec
from .federation import KINDS, ClientSide, answer, pack, run_server, unpack

DEFAULT_TIMEOUT = 600.0  # seconds a round's replies may take before the run stops with an error
STATE = "featcache.state"
_DATA: dict[tuple, tuple] = {}  # (cache, client, views) -> (train, test): a node's rows, read once per process


def _records(arrays: dict, skeleton: str) -> tuple[ArrayRecord, ConfigRecord]:
    return ArrayRecord({k: Array(np.ascontiguousarray(v.cpu().numpy())) for k, v in arrays.items()}), ConfigRecord(
        {"skeleton": skeleton}
    )


def to_records(tree) -> RecordDict:
    """A tree (`federation.pack`) as a message's content: "arrays" (ArrayRecord) and "tree" (its skeleton)."""
    return RecordDict(dict(zip(("arrays", "tree"), _records(*pack(tree)))))


def from_records(records: RecordDict) -> tuple[dict, str]:
    """(path -> tensor, skeleton) of a content `to_records` made."""
    return _tensors(records.array_records["arrays"]), str(records.config_records["tree"]["skeleton"])


def _tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(a.numpy())) for k, a in record.items()}


def _unwrapped(records: RecordDict):
    return unpack(*from_records(records))


def wire_bytes(records: RecordDict) -> int:
    """Bytes a message's content carries: its arrays (`ArrayRecord.count_bytes`) and its skeleton."""
    return records.array_records["arrays"].count_bytes() + len(str(records.config_records["tree"]["skeleton"]))


def resolve(run_config, algo, settings, seed, rounds) -> tuple:
    """(unbound algorithm, its resolved configuration with the seed) from the arguments, or the run config."""
    pick = lambda value, key, default=None: value if value is not None else run_config.get(key, default)
    name, seed = pick(algo, "algo"), int(pick(seed, "seed", 0))
    if not name:
        raise UserError("no algorithm: give algo= to the apps or `algo` in [tool.flwr.app.config]")
    given = pick(settings, "settings", "{}")
    given = json.loads(given) if isinstance(given, str) else dict(given)
    spec = RunSpec.resolve(name, pick(rounds, "rounds"), [seed], given)
    return spec.algo, spec.config | {"seed": seed}


def node_data(node_config, run_config, cache, algo) -> tuple:
    """(client index, train, test) of a node: `cache` (else the node config's, else the run config's) and the node's
    client index."""
    path = cache if cache is not None else node_config.get("cache") or run_config.get("cache")
    if not path:
        raise UserError("no cache for this node: give cache= to client_app or --node-config 'cache=PATH client=N'")
    index = node_config.get("client", node_config.get("partition-id"))
    views = bool(getattr(algo, "uses_views", False))
    key = (str(path), index, views)
    if key not in _DATA:
        _DATA[key] = cache_split.node_rows(path, None if index is None else int(index), views)
    return _DATA[key]


def client_app(algo=None, settings=None, seed=None, rounds=None, cache=None) -> ClientApp:
    """A `ClientApp` that holds one client of the run (see the module docstring for where each value comes from)."""
    app = ClientApp()

    def handle(msg: Message, context: Context) -> Message:
        impl, cfg = resolve(context.run_config, algo, settings, seed, rounds)
        index, train, test = node_data(context.node_config, context.run_config, cache, impl)
        client = ClientSide(impl, cfg, train, test, index)
        if STATE in context.state:
            tree = context.state.config_records[STATE + ".tree"]
            client.load_state_dict(_tensors(context.state.array_records[STATE]), str(tree["skeleton"]))
        reply = answer(client, msg.metadata.message_type, _unwrapped(msg.content))
        context.state[STATE], context.state[STATE + ".tree"] = _records(*client.state_dict())
        return Message(to_records(reply), reply_to=msg)

    for kind in KINDS:
        category, _, action = kind.partition(".")
        getattr(app, category)(action or "default")(handle)
    return app


class GridSend:
    """`run_server`'s `send` over a Flower `Grid`: messages to the nodes of the clients, every reply awaited for at
    most `timeout` seconds; records the bytes sent and received per message kind."""

    def __init__(self, grid: Grid, timeout: float):
        self.grid, self.timeout = grid, timeout
        self.node_of: dict[int, int] = {}
        self.bytes: dict[str, list[int]] = {}

    def __call__(self, kind: str, msgs):
        if msgs is None:  # "query": every node, which answers with its client index
            nodes = list(self.grid.get_node_ids())
            replies = self._exchange(kind, {n: ({}, n) for n in nodes})
            self.node_of = {r["client"]: n for n, r in replies.items()}
            return replies
        return self._exchange(kind, {c: (m, self.node_of[c]) for c, m in msgs.items()})

    def _exchange(self, kind: str, msgs: dict) -> dict:
        out = [Message(to_records(m), node, kind) for m, node in msgs.values()]
        ids = list(self.grid.push_messages(out))
        key_of = dict(zip(ids, msgs))
        sent = sum(wire_bytes(m.content) for m in out)
        replies: dict = {}
        t0 = time.monotonic()
        while len(replies) < len(ids) and time.monotonic() - t0 < self.timeout:
            for reply in self.grid.pull_messages([i for i in ids if key_of[i] not in replies]):
                key = key_of[reply.metadata.reply_to_message_id]
                if reply.has_error():
                    raise UserError(f"client {key} failed on {kind!r}: {reply.error.reason}")
                replies[key] = reply
            time.sleep(0.01 if len(replies) < len(ids) else 0)
        missing = [k for k in msgs if k not in replies]
        if missing:
            raise UserError(
                f"{len(missing)} client(s) ({', '.join(map(str, missing))}) did not answer {kind!r} within "
                f"{self.timeout:g} s: a node stopped or lost its connection; start it again and rerun"
            )
        got = sum(wire_bytes(r.content) for r in replies.values())
        self.bytes.setdefault(kind, []).append(sent + got)
        self.bytes.setdefault(f"{kind} up", []).append(got)
        self.bytes.setdefault(f"{kind} down", []).append(sent)
        return {k: _unwrapped(r.content) for k, r in replies.items()}


def server_app(algo=None, settings=None, seed=None, rounds=None, out=None, timeout=None, on_result=None) -> ServerApp:
    """A `ServerApp` that runs the federation's rounds (see the module docstring for where each value comes from);
    with `out` (or the run config's) it writes featcache's result files there. `on_result(raw, wire)` receives the
    raw figures and the bytes per message kind (the tests and bench/flower.py read them)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        impl, cfg = resolve(context.run_config, algo, settings, seed, rounds)
        wait = float(timeout if timeout is not None else context.run_config.get("timeout", DEFAULT_TIMEOUT))
        clients = int(context.run_config.get("clients", 0))
        _wait_for_nodes(grid, clients, wait)
        send = GridSend(grid, wait)
        raw = run_server(impl, cfg, send)
        target = out if out is not None else context.run_config.get("out", "")
        if target:
            from .results import write_result

            raw["result"] = write_result(target, raw["algo"], cfg, raw["meta"], raw, send.bytes)
        if on_result:
            on_result(raw, send.bytes)

    return app


def _wait_for_nodes(grid: Grid, clients: int, timeout: float) -> None:
    """Wait until `clients` nodes are connected (0: take those connected now), at most `timeout` seconds."""
    t0 = time.monotonic()
    while len(list(grid.get_node_ids())) < max(clients, 1):
        if time.monotonic() - t0 > timeout:
            raise UserError(f"only {len(list(grid.get_node_ids()))} of {clients} nodes connected within {timeout:g} s")
        time.sleep(0.5)
