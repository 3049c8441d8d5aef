"""The relay: the leading controller copies what each node wrote under its own keys into the
job-wide records, taking each node's word about itself only (docs/security.md).

Every tick, before it observes, the leader reads every known node's row (one MGET) and, for a
row that changed, writes the node's beat, deadline and summary into the job-wide sets (the
summary and deadline for the plan's nodes only: a rule reading those sets sees only the plan's
members); for a token that moved, it reads what changed and relays it:

- the node's record -> `nodes`, `unhealthy`, `registrations`;
- its exit records -> `exits`, only for ranks the record's generation's plan puts on that node
  (an exit in another node's name, or for another node's rank, is refused with an event);
- its events -> `events`, under its own name (`actor` "agent:<node>", `node`), whatever the
  entry said;
- its snapshot reports -> `snapshots` (`<node>`, `<node>@<incarnation>`);
- its hung ranks' stacks -> `stacks:<g>`, for the ranks the plan puts there;
- its rendezvous port -> `gen:<g>:master_port`, only from the node the plan puts rank 0 on.

Nodes are found by SCAN of `node:*:row` every DISCOVER_S (no job-wide set an agent could
write names into). The writes and the relay's cursors go in one transaction, so a leader that
takes over relays nothing twice and skips nothing.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable

from controller.store.mirror import READ_COUNT, Writes, cursors
from controller.store.own import INCARNATION, ROW_FIELDS, ROW_VERSION, TOKENS
from controller.store.summaries import SUMMARY_SETS
from optimus.contract.records import ExitRecord, RecordError

DISCOVER_S = 1.0
DRAIN_S = 10.0  # once the job ended: how long the relay waits for the agents' goodbyes
FIELD_MAX = 8_192  # characters of one relayed event field
EVENT_FIELDS = 32  # fields of one relayed event
# A row's summary field -> the job-wide sorted set it is relayed into (SUMMARY_SETS' order).
_SUMMARY = dict(zip(("max_step", "min_step", "outside", "compute_s", "paused", "oldest",
                     "peak_allocated", "peak_reserved"), SUMMARY_SETS, strict=True))


def parse_row(text: str | None) -> dict | None:
    """A row's fields (numbers, tokens as text, None for "-"), or None if it is no row."""
    if not isinstance(text, str):
        return None
    words = text.split(" ")
    if len(words) != len(ROW_FIELDS) + 1 or words[0] != ROW_VERSION:
        return None
    row = {}
    for name, word in zip(ROW_FIELDS, words[1:], strict=True):
        if word == "-":
            row[name] = None
        elif name in TOKENS:
            row[name] = word[:64]
        else:
            try:
                row[name] = float(word)
            except ValueError:
                return None
            if not math.isfinite(row[name]):
                return None  # NaN or infinite: no score
    return row


class Relay:
    """The leader's relay; `forget` when leadership is lost (the next leader reloads)."""

    def __init__(self, store, say: Callable[..., None], holder: str | None = None):
        self.store, self.say, self.holder = store, say, holder  # holder: of the leader lease
        self.forget()

    def forget(self) -> None:
        self.known: list[str] = []
        self.rows: dict[str, str] = {}  # node -> the row text last relayed
        self.cursors: dict[str, dict] | None = None
        self.next_discovery = 0.0
        self.refused: set[tuple[str, str]] = set()  # (node, what) said once per leadership
        self.beats: dict[str, float | None] = {}  # node -> its agent's last relayed beat
        self.mirrored: dict[str, dict] = {}  # node -> its place in each set, as last written
        self.drain_from: float | None = None
        self.seqs: dict[str, tuple[float, float]] = {}  # node -> (seq, beat) last relayed

    def run(self, plan: dict | None) -> None:
        """One pass (raises StoreUnavailable, like any tick's read). A pass that fails leaves
        nothing behind: the next one starts again from the stored cursors."""
        try:
            self._pass(plan)
        except BaseException:
            self.forget()
            raise

    def _pass(self, plan: dict | None) -> None:
        if self.cursors is None:
            self.cursors = {n: cursors(v) for n, v in self.store.mirror.relay_cursors().items()}
        if time.monotonic() >= self.next_discovery:
            self.next_discovery = time.monotonic() + DISCOVER_S
            self.known = self.store.mirror.discover()
        w = Writes()
        asks: list[tuple[str, str, object]] = []
        in_plan = set((plan or {}).get("nodes", []))
        for node, text in zip(self.known, self.store.mirror.rows(self.known), strict=True):
            if text is None or text == self.rows.get(node):
                continue
            row = parse_row(text)
            if row is None:
                self._refuse(node, "row", "its row is not one the agent writes")
                continue
            if self._late(node, row):
                continue
            self.rows[node] = text
            self._mirror_row(w, node, row, node in in_plan)
            seen = self.cursors.setdefault(node, {})
            for token in TOKENS:
                if row[token] is not None and row[token] != seen.get(token):
                    asks.append(self._ask(token, node, row[token], seen))
                    seen[token] = row[token]
        asks = [a for a in asks if a is not None]
        for (kind, node, arg), got in zip(asks, self.store.mirror.own_reads(asks), strict=True):
            getattr(self, f"_{kind}")(w, node, arg, got, plan)
            w.cursors[node] = json.dumps(self.cursors[node])
        if not self.store.mirror.write(w, self.holder):
            self.forget()  # another controller leads: whatever this pass read is its to relay

    def _ask(self, token: str, node: str, value: str, seen: dict) -> tuple | None:
        if token in ("exits", "events"):
            return (token, node, seen.get(f"{token}_id", ""))
        if token in ("stacks", "port"):
            generation = value.partition(":")[0]
            return (token, node, int(generation)) if generation.isdigit() else None
        return (token, node, None)

    def agents_left(self) -> bool:
        """Once the job has ended: whether an agent still beats (it leaves once it has stopped
        its ranks, saying so in an event that only a relay brings to the job's stream), for up
        to DRAIN_S from the first call."""
        now = time.monotonic()
        self.drain_from = self.drain_from or now
        beating = any(b is not None and time.time() - b < 3 * DISCOVER_S
                      for b in self.beats.values())
        return beating and now - self.drain_from < DRAIN_S

    def _late(self, node: str, row: dict) -> bool:
        """Whether `row` was written before the one last relayed: earlier by its writer's
        monotonic clock (`seq`) and by its beat, a write a network cut held back and the kernel
        delivered after the heal, over a newer one. Relayed, its beat would turn the node's
        agent back in time, seconds silent, and a healthy node lost. Either clock alone may go
        back for a good reason: the monotonic one when the host rebooted, the wall clock when
        NTP steps it."""
        last = self.seqs.get(node)
        if row["seq"] is None or row["beat"] is None:
            return False
        if last is not None and row["seq"] < last[0] and row["beat"] < last[1]:
            return True
        self.seqs[node] = (row["seq"], row["beat"])
        return False

    def _mirror_row(self, w: Writes, node: str, row: dict, planned: bool) -> None:
        """The row's place in each job-wide set, written where it changed (a row changes its
        beat every interval, its summary less often: at 10,923 nodes the writes are the
        relay's cost)."""
        self.beats[node] = row["beat"]
        summary = planned and row["max_step"] is not None
        want = {"agents": row["beat"], "beats": row["deadline"] if planned else None,
                **{key: row[name] if summary else None for name, key in _SUMMARY.items()},
                "nonfinite": planned and bool(row["nonfinite"])}
        had = self.mirrored.get(node, {})
        for key, value in want.items():
            if key not in had or had[key] != value:
                if key == "nonfinite":
                    w.member(key, node, value)
                else:
                    w.put(key, node, value)
        self.mirrored[node] = want

    # --- what a token points at ----------------------------------------------------------------

    def _info(self, w: Writes, node: str, _arg, raw, plan) -> None:
        try:
            info = json.loads(raw) if raw else None
        except ValueError:
            info = None
        if not isinstance(info, dict):
            self._refuse(node, "info", "its record is no JSON object")
            return
        w.nodes[node] = raw
        w.member("unhealthy", node, info.get("health") != "ok")
        w.registrations += 1

    def _more(self, node: str, token: str, entries: list) -> None:
        """A full read leaves more behind: read the stream again next pass."""
        if len(entries) >= READ_COUNT:
            self.cursors[node].pop(token, None)
            self.rows.pop(node, None)

    def _exits(self, w: Writes, node: str, _after, entries, plan) -> None:
        self._more(node, "exits", entries)
        for entry_id, fields in entries:
            self.cursors[node]["exits_id"] = entry_id
            try:
                record = json.loads(fields.get("json", ""))
            except ValueError:
                record = None
            why = exit_problem(node, record, plan)
            if why:
                self._refuse(node, f"exit {entry_id}", f"an exit record: {why}")
                continue
            w.exits.append(json.dumps(record))

    def _events(self, w: Writes, node: str, _after, entries, plan) -> None:
        self._more(node, "events", entries)
        for entry_id, fields in entries:
            self.cursors[node]["events_id"] = entry_id
            entry = {k[:64]: v[:FIELD_MAX] for k, v in list(fields.items())[:EVENT_FIELDS]}
            entry.update(actor=f"agent:{node}", node=node)
            w.events.append(entry)

    def _snapshots(self, w: Writes, node: str, _arg, fields, plan) -> None:
        for name, report in fields.items():
            if name == "now":
                w.snapshots[node] = report
            elif name.startswith("@") and INCARNATION.fullmatch(name[1:]):
                w.snapshots[f"{node}{name}"] = report

    def _stacks(self, w: Writes, node: str, generation: int, stacks, plan) -> None:
        mine = placed(node, plan, generation)
        kept = {r: t for r, t in stacks.items() if r.isdigit() and int(r) in mine}
        if len(kept) < len(stacks):
            self._refuse(node, f"stacks {generation}", f"stacks of ranks generation "
                         f"{generation}'s plan does not put on {node}")
        if kept:
            w.stacks.setdefault(generation, {}).update(kept)

    def _port(self, w: Writes, node: str, generation: int, raw, plan) -> None:
        if not (plan and plan.get("generation") == generation and plan.get("nodes")
                and plan["nodes"][0] == node):
            self._refuse(node, f"port {generation}", f"a rendezvous port for generation "
                         f"{generation}, whose rank 0 the plan puts on another node")
            return
        if isinstance(raw, str) and raw.isdigit() and 0 < int(raw) < 65_536:
            w.ports[generation] = int(raw)

    def _refuse(self, node: str, what: str, why: str) -> None:
        if (node, what) in self.refused:
            return
        self.refused.add((node, what))
        self.say("relay_refused", f"not relayed from node {node}: {why}", node=node)


def placed(node: str, plan: dict | None, generation: int) -> set[int]:
    """The global ranks `plan` puts on `node`, if it is `generation`'s plan (else none)."""
    if not plan or plan.get("generation") != generation or node not in plan.get("nodes", []):
        return set()
    rpn = int(plan.get("ranks_per_node") or 0)
    first = plan["nodes"].index(node) * rpn
    return set(range(first, first + rpn))


def exit_problem(node: str, record, plan: dict | None) -> str | None:
    """Why an exit record a node wrote is not to be relayed, or None: it is no whole, well-typed
    `ExitRecord` (the line names the field), or one about another node's rank."""
    try:
        exit_ = ExitRecord.parse(record)
    except RecordError as e:
        return e.what
    if exit_.node != node:
        return f"it names node {exit_.node[:64]!r}"
    generation, rank = exit_.generation, exit_.rank
    current = (plan or {}).get("generation", -1)
    if generation > current:
        return f"generation {generation} is not planned yet"
    if generation == current and rank not in placed(node, plan, generation):
        return f"generation {generation}'s plan does not put rank {rank} on {node}"
    return None
