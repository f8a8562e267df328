"""One featcache run split into a server and its clients, each holding only its own part, torch only (the Flower
apps in apps.py carry their messages).

The server is the engine's round loop (`Engine.run`) over the client backend `Transport`: the clients are reached
through messages, and the engine's state on the server holds all C clients as far as the server hooks read it: it
runs `init_state`, `aggregate`, `download` and `global_model` on it, with the participants' uploads stacked
[1, C, ...] and the engine's seeded participation. A client (`ClientSide`) holds one client's state, its models and
per-client state as a federation of one ([H, C] = [1, 1]) plus its copy of the server state, and trains with
`featcache.training.plain.local_epochs`, as the plain client backend trains each client of the engine's run: the
engine's first model, its batch order for that client, its optimizer settings, the hooks in the engine's order
(`client_side` after local training). Each client runs `download` itself on what `aggregate` returned, so state that
`download` derives from what a client trained (SCAFFOLD's control variates) is computed where that lives.

Where `init_state` exchanges data (FedPCL's initial prototypes), the server's `after_local` and `upload` are the
clients' own: the clients compute them on their rows and the server aggregates what they send. Messages are trees of
tensors and JSON values in the checkpoint's codec (`runs.trees`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import torch

from ..cache import ClientData
from ..errors import UserError
from ..runs import trees
from ..training.engine import Clients, Engine, Local, Round, State, client_side, first_models, initial_state, setup
from ..training.evaluate import accuracy_loss, hits, scores
from ..training.plain import client_order, train_alone
from ..training.schedule import evaluates

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
    """A tree of tensors and JSON values as (name -> 1-d tensor, the rest as JSON): the checkpoint's codec
    (`runs.trees.pack`), so a tree arrives in the layouts it was sent in."""
    try:
        skeleton, spans, pads = trees.pack(tree)
    except trees.Unsupported as e:
        raise UserError(f"{e.name} (a {e.kind}) cannot travel as a Flower record: send tensors and numbers") from None
    return spans, json.dumps({"skeleton": skeleton, "pads": pads})


def unpack(arrays: dict[str, torch.Tensor], text: str):
    """The tree `pack` took apart."""
    got = json.loads(text)
    return trees.unpack(got["skeleton"], arrays, got["pads"])


class ClientSide:
    """Client `index` of the federation: its own rows `train`, `test` (C = 1) and its state (once `start` or
    `load_state_dict` made it)."""

    def __init__(self, algo, cfg: dict, train: ClientData, test: ClientData, index: int):
        self.cfg, self.index = cfg, index
        self.train, self.test = train, test
        self.algo, _, self.frame = setup(algo, [cfg], train, torch.device("cpu"))
        refuse(self.algo)
        self.init_uploads = False
        self._state: State | None = None

    @property
    def started(self) -> bool:
        return self._state is not None

    @property
    def state(self) -> State:
        if self._state is None:
            raise RuntimeError("ClientSide.start() first")
        return self._state

    def start(self) -> None:
        """Round 1's state, as the engine's `initial_state` gives this client (its `init_state` on its rows), and
        whether `init_state` asked for `upload` (then the server aggregates the clients' `init_upload`)."""
        spy, asked = copy.copy(self.algo), []

        def upload(state, rnd):
            asked.append(True)
            return type(self.algo).upload(spy, state, rnd)

        spy.upload = upload
        self._state = initial_state(spy, first_models(self.algo, self.frame), self.frame)
        self.init_uploads = bool(asked)

    def round(self, rnd: int, took_part: bool = True) -> Round:
        return self.frame.round(rnd, [[took_part]])

    # -- the state between messages -----------------------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, torch.Tensor], str]:
        return pack(self.state.groups())

    def load_state_dict(self, arrays: dict, skeleton: str) -> None:
        self._state = State(**unpack(arrays, skeleton))

    # -- hooks --------------------------------------------------------------------------------------------------
    def init_upload(self) -> dict:
        """What `init_state`'s `upload` sends from this client (name -> [1, 1, ...]; {} where it asks for none)."""
        return self.algo.upload(self.state, self.round(-1)) if self.init_uploads else {}

    def fit(self, rnd: int) -> tuple[dict, float]:
        """Round `rnd`'s local epochs, then `client_side`: (uploads name -> [1, 1, ...], mean local loss)."""
        algo, state, cfg = self.algo, self.state, self.cfg
        now = self.round(rnd)
        ctxs = [algo.context(state, replace(now, epoch=e)) for e in range(algo.local_epochs())]  # before training
        order = client_order(self.frame.seeds, rnd, self.index, int(self.train.counts[0]))  # its order among all C
        params, buffers, loss = train_alone(algo, cfg, now, state, 0, self.train, order, ctxs)
        state.params = {k: v.detach()[None, None].clone() for k, v in params.items()}
        state.buffers = {k: v.detach()[None, None].clone() for k, v in buffers.items()}
        return client_side(algo, state, now), float(loss)

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


def stack(uploads: dict[int, dict], C: int) -> dict:
    """Some clients' uploads (client -> name -> [1, 1, ...]) as name -> [1, C, ...], zeros elsewhere."""
    ids, some = torch.tensor(list(uploads)), next(iter(uploads.values()))
    sent = lambda k: torch.cat([up[k] for up in uploads.values()], 1)  # [1, P, ...]
    return {k: torch.zeros(1, C, *v.shape[2:], dtype=v.dtype).index_copy_(1, ids, sent(k)) for k, v in some.items()}


class Transport(Clients):
    """The client backend of a Flower server: the clients are nodes that `send(kind, {client: message}) -> {client:
    reply}` reaches (`answer` there); they train, run the clients' side, `download` and score on their own state.
    `hello`: each client's answer to "query", by client index."""

    def __init__(self, send, hello: dict[int, dict]):
        self.send, self.hello = send, hello
        self.unsent = set(hello)  # the clients that have not received the server's state yet
        self.figures: dict = {}  # client -> its figures of the last evaluation round
        self.model = None  # the server's global model they scored there, if any

    def refuse(self, algo, H: int) -> None:
        refuse(algo)

    def initial(self, algo):
        """`algo` whose `after_local` and `upload` in `init_state` are the clients' (their answers to "query")."""
        proxy = copy.copy(algo)
        proxy.after_local = lambda state, rnd: None
        proxy.upload = lambda state, rnd: stack({c: r["uploads"] for c, r in self.hello.items()}, len(self.hello))
        return proxy

    def first(self, eng: Engine, c: int, msg: dict) -> dict:
        """`msg` with the server's state where it is client c's first message."""
        if c not in self.unsent:
            return msg
        self.unsent.discard(c)
        return msg | {"server_state": eng.state.server}

    def fit(self, eng: Engine, state: State, now: Round, part: list, aside: tuple = ()) -> Local:
        chosen = [c for c, p in enumerate(part[0]) if p]
        replies = self.send("train", {c: self.first(eng, c, {"round": now.round}) for c in chosen})
        loss = torch.full((1, eng.C), torch.nan)  # [1, C]
        loss[0, chosen] = torch.tensor([replies[c]["loss"] for c in chosen])
        uploads = stack({c: replies[c]["uploads"] for c in chosen}, eng.C)  # name -> [1, C, ...]
        return Local(~loss.isfinite() & now.part, loss, now, (uploads, eng.train.counts[None].float() * now.part))

    def take(self, eng: Engine, now: Round, server) -> None:
        """`download` on every client, which scores itself there after an evaluation round."""
        evaluate = evaluates(now.round, eng.cfg)
        self.model = eng.algo.global_model(eng.state, now) if evaluate else None
        sent = {"round": now.round, "server": server, "evaluate": evaluate, "first": not eng.loop.records}
        if self.model is not None and not eng.algo.clients_hold_global:
            sent["model"] = self.model
        msgs = {c: self.first(eng, c, sent | {"took_part": p}) for c, p in enumerate(now.part[0].tolist())}
        self.figures = self.send("evaluate", msgs)

    def score(self, eng: Engine, now: Round, round_loss: torch.Tensor, logs: bool) -> dict:
        got = {k: [self.figures[c][k] for c in range(eng.C)] for k in self.figures[0]}  # name -> C values
        rows = {k: torch.tensor([got[k]], dtype=torch.float32) for k in ("test_acc", "test_loss", "train_acc")}
        glob = None if self.model is None else torch.tensor([sum(got["global_hits"])]) / max(sum(got["test_rows"]), 1)
        return rows | {"train_loss": round_loss, "global_acc": glob}  # [1, C] each, global_acc [1]


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


def run_server(algo, cfg: dict, send, progress=None) -> dict:
    """The federation's rounds from the server: `Engine.run` of `algo` at `cfg` (its seed included) over the clients
    `send(kind, {client: message}) -> {client: reply}` reaches (`Transport`; all messages answered, or an error
    raised). Returns `Engine.run`'s output with the bound algorithm and the clients' cache metadata (`meta`)."""
    replies = send("query", None)
    ids, C = sorted(r["client"] for r in replies.values()), len(replies)
    if ids != list(range(C)):
        raise UserError(f"the {C} clients answered as clients {ids}: give each node one client index 0..{C - 1}")
    by = {r["client"]: r for r in replies.values()}
    counts, first = [by[c]["train"] for c in range(C)], by[0]
    N, D, K, V = max(counts), first["dim"], first["classes"], first["views"]
    skeleton = ClientData(  # the clients' shape, no rows: the server hooks read counts, never features
        torch.zeros(()).expand(C, N, D),
        torch.full((C, N), -1),
        torch.tensor(counts),
        K,
        torch.zeros(()).expand(C, N, V, D) if V else None,
    )
    engine = Engine(algo, [cfg], skeleton, skeleton, clients=Transport(send, by))
    return engine.run(progress) | {"algo": engine.algo, "meta": first["meta"]}


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
