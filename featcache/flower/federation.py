"""One featcache run split into a server and its clients, each holding only its own part, torch only (the Flower
apps in apps.py carry their messages).

A client (`ClientSide`) holds one client's state, its models and per-client state as a federation of one
([H, C] = [1, 1]) plus its copy of the server state, and trains with `featcache.training.plain.local_epochs`, the
function `featcache.testing.plain_loop` trains each client of the engine's run with: the engine's first model, its
batch order for that client (a pure function of seed, round, epoch and client id), its optimizer settings, the hooks
in the engine's order (`client_side` after local training). The server (`ServerSide`) holds the state of all C
clients as far as the server hooks read it: it runs `init_state`, `aggregate`, `download` and `global_model` on it,
with the participants' uploads stacked [1, C, ...] and the engine's seeded participation. Each client runs
`download` itself on what `aggregate` returned, so state that `download` derives from what a client trained
(SCAFFOLD's control variates) is computed where that lives.

Where `init_state` exchanges data (FedPCL's initial prototypes), the server's `after_local` and `upload` are the
clients' own: the clients compute them on their rows and the server aggregates what they send.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import replace

import torch

from ..cache import ClientData
from ..errors import UserError
from ..training.config import batched
from ..training.engine import Frame, State, client_side, initial_state
from ..training.evaluate import accuracy_loss, hits, scores
from ..training.hparams import HParams
from ..training.plain import client_optimizer, local_epochs
from ..training.schedule import batch_order, participation, plan_steps

GROUPS = ("params", "buffers", "client", "server")

# What a client alone cannot do beyond what the algorithm declares (`across_clients`): (test on the bound
# algorithm, the one-line reason)
REFUSALS = (
    (
        lambda algo: algo.keeps_optimizer_state,
        "keeps_optimizer_state: its optimizer moments live in one torch.optim object per client for the whole run, "
        "which Flower's context state does not hold",
    ),
    (
        lambda algo: algo.cfg.get("proto_noise", "none") != "none",
        "proto_noise: `privatize` draws the noise of all C clients from one (seed, round) generator, which a client "
        "alone cannot reproduce",
    ),
)


def refuse(algo) -> None:
    """One line naming what of the bound algorithm cannot run client-side as written, and why: its own declaration
    first, then `REFUSALS`."""
    why = algo.across_clients or next((why for test, why in REFUSALS if test(algo)), "")
    if why:
        raise UserError(f"{algo.name} cannot run as a Flower app: {why}; run it with `featcache train`")


def pack(tree) -> tuple[dict[str, torch.Tensor], str]:
    """A nested dict of tensors (and JSON values) as (path -> tensor, its skeleton as JSON): paths join keys by '/'."""
    arrays: dict[str, torch.Tensor] = {}

    def walk(node, path):
        if torch.is_tensor(node):
            arrays[path] = node.detach().contiguous()
            return {"@tensor": path}
        if isinstance(node, dict):
            bad = [k for k in node if not isinstance(k, str) or "/" in k]
            if bad:
                raise UserError(f"state key {bad[0]!r} cannot travel as a Flower record: keys must be '/'-free strings")
            return {k: walk(v, f"{path}/{k}" if path else k) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return {"@items": [walk(v, f"{path}/{i}") for i, v in enumerate(node)], "@tuple": isinstance(node, tuple)}
        return {"@value": node}

    return arrays, json.dumps(walk(tree, ""))


def unpack(arrays: dict[str, torch.Tensor], skeleton: str):
    """The tree `pack` took apart."""

    def build(node):
        if "@tensor" in node:
            return arrays[node["@tensor"]]
        if "@value" in node:
            return node["@value"]
        if "@items" in node:
            items = [build(v) for v in node["@items"]]
            return tuple(items) if node["@tuple"] else items
        return {k: build(v) for k, v in node.items()}

    return build(json.loads(skeleton))


def shared_setup(algo, cfg: dict, data: ClientData, device="cpu"):
    """(bound algorithm, Frame) of one configuration `cfg` (seed included) on `data`, as the engine binds them."""
    shared, floats = batched([cfg], algo)
    bound = algo.bind(shared)
    plan = plan_steps(data, cfg["batch_size"], cfg["drop_last"])
    seeds = torch.tensor([cfg["seed"]])
    frame = Frame(plan.steps, plan.client_steps, seeds, HParams.of(floats, device), shared, data, torch.device(device))
    return bound, frame


def first_models(algo, frame: Frame, d_in: int, K: int) -> list:
    """The engine's round-1 model (`Engine.init_state`): one per configuration, from its seed."""
    return [algo.init(frame.cfg, d_in, K, torch.Generator().manual_seed(int(s))) for s in frame.seeds]


class _Started:
    """The state a side holds once `start` (or `load_state_dict`) made it."""

    _state: State | None = None

    @property
    def started(self) -> bool:
        return self._state is not None

    @property
    def state(self) -> State:
        if self._state is None:
            raise RuntimeError(f"{type(self).__name__}.start() first")
        return self._state

    @state.setter
    def state(self, state: State) -> None:
        self._state = state


class ClientSide(_Started):
    """Client `index` of the federation: its own rows `train`, `test` (C = 1) and its state."""

    def __init__(self, algo, cfg: dict, train: ClientData, test: ClientData, index: int):
        self.cfg, self.index = cfg, index
        self.train, self.test = train, test
        self.algo, self.frame = shared_setup(algo, cfg, train)
        refuse(self.algo)
        self.init_uploads = False

    def start(self) -> None:
        """Round 1's state, as the engine's `initial_state` gives this client (its `init_state` on its rows), and
        whether `init_state` asked for `upload` (then the server aggregates the clients' `init_upload`)."""
        models = first_models(self.algo, self.frame, self.train.features.shape[-1], self.train.num_classes)
        spy, asked = copy.copy(self.algo), []

        def upload(state, rnd):
            asked.append(True)
            return type(self.algo).upload(spy, state, rnd)

        spy.upload = upload
        self.state = initial_state(spy, models, self.frame)
        self.init_uploads = bool(asked)

    def round(self, rnd: int, took_part: bool = True):
        return self.frame.round(rnd, [[took_part]])

    # -- the state between messages -----------------------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, torch.Tensor], str]:
        return pack(self.state.groups())

    def load_state_dict(self, arrays: dict, skeleton: str) -> None:
        self.state = State(**unpack(arrays, skeleton))

    # -- hooks --------------------------------------------------------------------------------------------------
    def init_upload(self) -> dict:
        """What `init_state`'s `upload` sends from this client (name -> [1, 1, ...]; {} where it asks for none)."""
        return self.algo.upload(self.state, self.round(-1)) if self.init_uploads else {}

    def fit(self, rnd: int) -> tuple[dict, float]:
        """Round `rnd`'s local epochs, then `client_side`: (uploads name -> [1, 1, ...], mean local loss)."""
        algo, state, cfg, c = self.algo, self.state, self.cfg, self.index
        now = self.round(rnd)
        n = int(self.train.counts[0])
        ctxs = [algo.context(state, replace(now, epoch=e)) for e in range(algo.local_epochs())]  # before training
        buffers = {k: v[0, 0].clone() for k, v in state.buffers.items()}
        params = {k: v[0, 0].clone().requires_grad_(True) for k, v in state.params.items()}
        opt = client_optimizer(algo, cfg, params)
        counts = torch.zeros(c + 1, dtype=torch.int64)
        counts[c] = n  # this client's count at its own id: its batch order is the one it has among all C
        order = lambda epoch: batch_order(self.frame.seeds, rnd, epoch, counts, n, torch.tensor([[c]]))[0, 0]  # [n]
        total, steps = local_epochs(algo, cfg, now, params, buffers, opt, self.train, 0, order, ctxs)
        state.params = {k: v.detach()[None, None].clone() for k, v in params.items()}
        state.buffers = {k: v.detach()[None, None].clone() for k, v in buffers.items()}
        return client_side(algo, state, now), float(total / max(steps, 1))

    def take(self, rnd: int, server, took_part: bool) -> None:
        """`download` of what the server aggregated in round `rnd` (every client takes it, as in the engine)."""
        self.algo.download(self.state, server, self.round(rnd, took_part))

    @torch.no_grad()
    def score(self, rnd: int, took_part: bool, first: bool, model=None) -> dict:
        """This client's figures after round `rnd` (`evaluate.record`'s, C = 1) and its hits of the global model on
        its test rows: `model` (params, buffers) name -> [1, ...] when the server sent one, else its own model's."""
        algo, state, now = self.algo, self.state, self.round(rnd, took_part)
        test_scores = scores(algo, state, self.test, now, first=first)  # [1, 1, N, K]
        test_hits = hits(test_scores, self.test)  # [1, 1, N]
        test_acc, test_loss = accuracy_loss(test_scores, self.test, test_hits)
        train_acc, _ = accuracy_loss(scores(algo, state, self.train, now), self.train)
        if model is not None:
            test_hits = hits(scores(algo, state, self.test, now, model, first), self.test)
        return {
            "test_acc": float(test_acc[0, 0]),
            "test_loss": float(test_loss[0, 0]),
            "train_acc": float(train_acc[0, 0]),
            "global_hits": int(test_hits.sum()),
            "test_rows": int(self.test.counts[0]),
        }


class ServerSide(_Started):
    """The server of a federation of `counts` clients (their training rows), `K` classes, `D` input features."""

    def __init__(self, algo, cfg: dict, counts: list[int], K: int, D: int, views: int = 0):
        C, N = len(counts), max(counts)
        skeleton = ClientData(  # the clients' shape, no rows: the server hooks read counts, never features
            torch.zeros(()).expand(C, N, D),
            torch.full((C, N), -1),
            torch.tensor(counts),
            K,
            torch.zeros(()).expand(C, N, views, D) if views else None,
        )
        self.cfg, self.C, self.K, self.D = cfg, C, K, D
        self.algo, self.frame = shared_setup(algo, cfg, skeleton)
        refuse(self.algo)
        self.counts = skeleton.counts

    def start(self, init_uploads) -> None:
        """Round 1's state; `init_uploads()` returns the clients' uploads [1, C, ...] where `init_state` asks for
        them (its `after_local` and `upload` run on the clients)."""
        proxy = copy.copy(self.algo)
        proxy.after_local = lambda state, rnd: None
        proxy.upload = lambda state, rnd: init_uploads()
        models = first_models(self.algo, self.frame, self.D, self.K)
        self.state = initial_state(proxy, models, self.frame)

    def participants(self, rnd: int) -> list[int]:
        """The clients of round `rnd`: the engine's seeded draw."""
        part = participation(self.frame.seeds, rnd, self.C, self.cfg["participation"])[0]
        return [c for c in range(self.C) if part[c]]

    def stack(self, uploads: dict[int, dict]) -> dict:
        """The participants' uploads (client -> name -> [1, 1, ...]) as name -> [1, C, ...], zeros elsewhere."""
        some = next(iter(uploads.values()))
        out = {}
        for k, v in some.items():
            t = torch.zeros(1, self.C, *v.shape[2:], dtype=v.dtype)
            for c, up in uploads.items():
                t[0, c] = up[k][0, 0]
            out[k] = t
        return out

    def serve(self, rnd: int, uploads: dict[int, dict]):
        """Round `rnd`'s server side (`aggregate`, `download` on the server's state): returns what `aggregate`
        gave, for every client's own `download`."""
        part = [[c in uploads for c in range(self.C)]]
        now = self.frame.round(rnd, part)
        weights = self.counts[None].float() * now.part  # [1, C]
        server = self.algo.aggregate(self.stack(uploads), weights, self.state, now)
        self.algo.download(self.state, server, now)
        return server

    def global_model(self, rnd: int):
        """The server's model after round `rnd` ((params, buffers) name -> [1, ...]) or None."""
        part = [[c in self.participants(rnd) for c in range(self.C)]]
        return self.algo.global_model(self.state, self.frame.round(rnd, part))


# -- the messages: what the server asks, what a client answers (trees of tensors and JSON values) -------------------
def answer(client: ClientSide, kind: str, msg: dict) -> dict:
    """Client `client`'s reply to a message of `kind` (`KINDS`); starts its state on the first message and takes
    the server's initial state from the first message that carries it."""
    if not client.started:
        client.start()
    if "server_state" in msg:
        client.state.server = msg["server_state"]
    return KINDS[kind](client, msg)


def _hello(client: ClientSide, msg: dict) -> dict:
    """Who the client is, its rows' shape and what `init_state`'s `upload` sends from it (used where asked for)."""
    t = client.train
    views = 0 if t.views is None else t.views.shape[2]
    meta = {k: t.meta.get(k) for k in ("key", "dataset", "backbones", "partition")}
    shape = {"train": int(t.counts[0]), "classes": t.num_classes, "dim": t.features.shape[-1], "views": views}
    return {"client": client.index, "meta": meta, "uploads": client.init_upload()} | shape


def _train(client: ClientSide, msg: dict) -> dict:
    uploads, loss = client.fit(msg["round"])
    return {"uploads": uploads, "loss": loss}


def _download(client: ClientSide, msg: dict) -> dict:
    rnd, took_part = msg["round"], msg["took_part"]
    client.take(rnd, msg["server"], took_part)
    if not msg["evaluate"]:
        return {}
    return client.score(rnd, took_part, msg["first"], msg.get("model"))


KINDS = {"query": _hello, "train": _train, "evaluate": _download}


def run_server(server_of, send, rounds: int, eval_every: int, progress=None) -> dict:
    """The federation's rounds from the server: `send(kind, {client: message}) -> {client: reply}` carries the
    messages (all of them answered, or an error raised); `server_of(replies to "query")` makes the `ServerSide`.
    Returns the engine's raw output (`Loop.result`: test_acc, test_loss, train_acc, train_loss [R_eval, 1, C],
    global_acc [R_eval, 1] or None, eval_rounds, upload_floats, round_seconds) and the bytes per round."""
    hello = send("query", None)
    server: ServerSide = server_of(hello)
    everyone = range(server.C)
    server.start(lambda: server.stack({r["client"]: r["uploads"] for r in hello.values()}))
    unsent = set(everyone)  # the clients that have not received the server's initial state yet

    def first(c: int, msg: dict) -> dict:
        """`msg` with the server's initial state where it is client c's first message since `start`."""
        if c not in unsent:
            return msg
        unsent.discard(c)
        return msg | {"server_state": server.state.server}

    records: list[dict] = []
    eval_rounds, floats, seconds = [], [], []
    for rnd in range(rounds):
        t0 = time.perf_counter()
        chosen = server.participants(rnd)
        replies = send("train", {c: first(c, {"round": rnd}) for c in chosen})
        uploads = {c: replies[c]["uploads"] for c in chosen}
        payload = server.serve(rnd, uploads)
        floats.append(sum(v[0, 0].numel() for v in next(iter(uploads.values())).values()))
        evaluate = (rnd + 1) % eval_every == 0 or rnd == rounds - 1
        model = server.global_model(rnd) if evaluate else None
        sent = {"round": rnd, "server": payload, "evaluate": evaluate, "first": not records}
        if model is not None and not server.algo.clients_hold_global:
            sent["model"] = model
        figures = send("evaluate", {c: first(c, sent | {"took_part": c in uploads}) for c in everyone})
        seconds.append(time.perf_counter() - t0)
        if evaluate:
            row = lambda k: torch.tensor([[figures[c][k] for c in everyone]], dtype=torch.float32)  # [1, C]
            loss = torch.tensor([[replies[c]["loss"] if c in replies else float("nan") for c in everyone]])
            glob = None
            if model is not None:
                total = sum(figures[c]["global_hits"] for c in everyone)
                glob = torch.tensor([total]) / max(sum(figures[c]["test_rows"] for c in everyone), 1)
            records.append(
                {
                    "test_acc": row("test_acc"),
                    "test_loss": row("test_loss"),
                    "train_acc": row("train_acc"),
                    "train_loss": loss,
                    "global_acc": glob,
                }
            )
            eval_rounds.append(rnd + 1)
        if progress:
            progress(rnd + 1, rounds)
    stacked = {k: None if records[0][k] is None else torch.stack([r[k] for r in records]) for k in records[0]}
    return stacked | {
        "acc": stacked["test_acc"],
        "eval_rounds": eval_rounds,
        "upload_floats": floats,
        "round_seconds": seconds,
        "clients": server.C,
        "algo": server.algo,
    }


def wire(tree):
    """`tree` as the other side receives it: packed and unpacked, its tensors copied (nothing shared in memory)."""
    arrays, skeleton = pack(tree)
    return unpack({k: v.clone() for k, v in arrays.items()}, skeleton)


def loopback(clients: list[ClientSide]):
    """A `send` for `run_server` that hands every message to the clients in this process, through `wire`."""

    def send(kind: str, msgs):
        msgs = msgs or dict.fromkeys(range(len(clients)), {})
        return {c: wire(answer(clients[c], kind, wire(m))) for c, m in msgs.items()}

    return send


def server_from_hello(algo, cfg: dict):
    """The `server_of` of `run_server`: a `ServerSide` from the clients' answers to "query"."""

    def make(hello: dict) -> ServerSide:
        C = len(hello)
        if sorted(r["client"] for r in hello.values()) != list(range(C)):
            raise UserError(
                f"the {C} clients answered as clients {sorted(r['client'] for r in hello.values())}: "
                f"give each node one client index 0..{C - 1}"
            )
        by = {r["client"]: r for r in hello.values()}
        return ServerSide(algo, cfg, [by[c]["train"] for c in range(C)], by[0]["classes"], by[0]["dim"], by[0]["views"])

    return make
