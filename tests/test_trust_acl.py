"""The write matrix of deploy/redis-users.acl and of the per-node users
(controller/store/acl.py): every write command Redis has, tried by ACL DRYRUN as each agent
identity against the keys it must not change (issue 29, item 5).

The ACL is the line between a node and the job: an agent must not push commands into another
node's list (`kill_node`, `bad_tile` for any node), nor write what the controller decides (the
plan, the control word, the job record, exclusions) or relays (the job-wide node records,
exits, events), or what operators ask (`requests`), nor run keyless writes (FLUSHALL,
FUNCTION LOAD); a node's own user reaches its own keys (`node:<node>:*`) and no other node's.
DRYRUN checks a command against a user without running it; the arguments are built from each
command's key specifications (COMMAND INFO), and a user with every command but no key checks
that they name the key where Redis looks for it, so a command the probe could not aim at a key
fails the test instead of passing it by accident. docs/security.md, "Redis".
"""

from __future__ import annotations

import pytest
import redis
from cluster import ROOT, RedisServer

from controller.store.acl import create_node_users

PROBE_USERS = ("user probe-admin on >probe ~* &* +@all\n"  # runs ACL DRYRUN; test-only users
               "user probe-nokeys on nopass resetkeys +@all\n")
KEY = "optimus:{{j}}:{name}"
# Written by the controller or asked by operators: never by an agent's credentials.
CONTROLLER_KEYS = ("plan", "plan:stamp", "control", "job", "excluded", "requests", "leader",
                   # what the controller relays from the nodes' own keys (relay.py)
                   "nodes", "agents", "beats", "steps", "unhealthy", "nonfinite", "exits",
                   "events", "snapshots", "registrations", "relayed", "stacks:3",
                   "gen:3:master_port")
READABLE = ("plan", "plan:stamp", "control", "gen:3:master_port")  # agents read these
OWN_KEYS = ("row", "info", "status", "ranks", "exits", "events", "snapshots", "stacks:3",
            "port:3")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("acl")
    acl = (ROOT / "deploy" / "redis-users.acl").read_text().replace("CHANGE-ME", "pw")
    (tmp / "users.acl").write_text(acl + PROBE_USERS)
    server = RedisServer(tmp, "--aclfile", str(tmp / "users.acl"))
    admin = redis.Redis(port=server.port, username="probe-admin", password="probe",
                        decode_responses=True)
    admin.response_callbacks.pop("COMMAND", None)  # redis-py misreads COMMAND LIST / INFO
    create_node_users(admin, "j", {"node0": "pw0", "node1": "pw1"})
    yield admin
    admin.close()
    server.stop()


def _spec(value) -> dict:
    return value if isinstance(value, dict) else dict(zip(value[::2], value[1::2], strict=True))


def _argv(info: list, key: str) -> list[str]:
    """A command line of `info`'s command with `key` wherever its key specs look for keys."""
    name, arity, specs = info[0], info[1], info[8]
    if name == "bitfield":  # a write only with SET / INCRBY: without, read access suffices
        return ["bitfield", key, "SET", "u8", "0", "1"]
    words = name.split("|")
    argv = words + [key] * max(abs(arity) - len(words), 0)
    for raw in specs:
        spec = _spec(raw)
        begin, find = _spec(spec["begin_search"]), _spec(spec["find_keys"])
        if begin["type"] == "keyword":  # SORT ... STORE key, XREADGROUP ... STREAMS key id
            argv += [_spec(begin["spec"])["keyword"], key, key]
            at = len(argv) - 2
        elif begin["type"] == "index":
            at = _spec(begin["spec"])["index"]
        else:  # "unknown": keys Redis cannot find from the arguments (MIGRATE's legacy form)
            continue
        if find["type"] == "keynum":  # LMPOP numkeys key ..., ZUNIONSTORE dest numkeys key ...
            keys = _spec(find["spec"])
            argv += [key] * max(0, at + keys["firstkey"] + 1 - len(argv))
            argv[at + keys["keynumidx"]], argv[at + keys["firstkey"]] = "1", key
        else:
            argv += [key] * max(0, at + 1 - len(argv))
            argv[at] = key
    return argv


def _allowed(admin, user: str, key: str) -> dict[str, bool]:
    """Every write command -> whether `user` may run it on `key` (keyless ones: at all)."""
    names = sorted(admin.execute_command("COMMAND", "LIST", "FILTERBY", "ACLCAT", "write"))
    infos = [i for i in admin.execute_command("COMMAND", "INFO", *names) if i]
    assert len(infos) > 90, "COMMAND INFO answered too few commands to probe"
    out = {}
    for info in infos:
        argv = _argv(info, key)
        keyed = bool(info[8]) and info[0] != "migrate"  # MIGRATE: its keys move elsewhere
        if keyed:  # the probe names the key where Redis looks: a keyless user is refused
            assert admin.execute_command("ACL", "DRYRUN", "probe-nokeys", *argv) != "OK", argv
        out[info[0]] = admin.execute_command("ACL", "DRYRUN", user, *argv) == "OK"
    return out


def test_an_agent_may_only_pop_a_command_list_not_fill_one(server):
    """RPUSHX, LPUSHX, LINSERT, LSET, LMOVE, COPY... were open on `commands:*`: one node's
    credentials queued kill_node or bad_tile for every other node."""
    allowed = _allowed(server, "optimus-agent", KEY.format(name="commands:node1"))
    assert sorted(c for c, ok in allowed.items() if ok) == ["lpop"]


@pytest.mark.parametrize("name", CONTROLLER_KEYS)
def test_an_agent_writes_nothing_the_controller_decides_or_operators_ask(server, name):
    """XREADGROUP is a write (it moves a consumer group's cursor) that read access allows:
    on the plan and the control word, which agents read, it can only fail (they are strings,
    not streams)."""
    for user in ("optimus-agent", "optimus-node-node0"):
        allowed = _allowed(server, user, KEY.format(name=name))
        assert sorted(c for c, ok in allowed.items() if ok) == (
            ["xreadgroup"] if name in READABLE else []), (user, name)


def test_an_agent_runs_no_keyless_write(server):
    """FLUSHALL, FLUSHDB, SWAPDB (dangerous) and FUNCTION LOAD / DELETE / FLUSH / RESTORE
    (scripting: +@write granted them)."""
    for user in ("optimus-agent", "optimus-node-node0"):
        allowed = _allowed(server, user, KEY.format(name="nodes"))
        keyless = [c for c in allowed if c in ("flushall", "flushdb", "swapdb")
                   or c.startswith("function|")]
        assert len(keyless) == 7 and not any(allowed[c] for c in keyless), user


def test_the_operator_may_only_ask_and_queue_commands(server):
    for name, want in (("requests", ["xadd"]), ("commands:node1", ["rpush"]), ("plan", []),
                       ("nodes", []), ("job", [])):
        allowed = _allowed(server, "optimus-operator", KEY.format(name=name))
        assert sorted(c for c, ok in allowed.items() if ok) == want, name


@pytest.mark.parametrize("name", OWN_KEYS)
def test_a_nodes_own_user_writes_its_own_keys_and_no_other_nodes(server, name):
    mine = _allowed(server, "optimus-node-node0", KEY.format(name=f"node:node0:{name}"))
    theirs = _allowed(server, "optimus-node-node0", KEY.format(name=f"node:node1:{name}"))
    assert {"set", "hset", "xadd", "del", "expire"} <= {c for c, ok in mine.items() if ok}
    assert [c for c, ok in theirs.items() if ok] == []
    # The shared agent user reaches every node's own keys: what the per-node users are for.
    assert _allowed(server, "optimus-agent", KEY.format(name=f"node:node1:{name}"))["xadd"]


def test_a_nodes_own_user_pops_its_own_commands_only(server):
    user = "optimus-node-node0"
    own = _allowed(server, user, KEY.format(name="commands:node0"))
    assert sorted(c for c, ok in own.items() if ok) == ["lpop"]
    assert [c for c, ok in _allowed(server, user, KEY.format(name="commands:node1")).items()
            if ok] == []


def test_wake_channels_agents_hear_the_controller_and_wake_only_the_controller(server):
    """controller/store/wake.py: a wake carries nothing that is read, but a node that could
    publish on wake:agents would make every agent tick at will; nor may it listen on the
    controller's channel. Other channels, another job's included, are closed to it."""
    def may(user: str, *argv: str) -> bool:
        return server.execute_command("ACL", "DRYRUN", user, *argv) == "OK"

    agents, controller = "optimus:{j}:wake:agents", "optimus:{j}:wake:controller"
    for user in ("optimus-agent", "optimus-node-node0"):
        assert may(user, "SUBSCRIBE", agents) and may(user, "PUBLISH", controller, "")
        assert not may(user, "PUBLISH", agents, "") and not may(user, "SUBSCRIBE", controller)
        for other in ("optimus:{j}:plan", "optimus:{j}:wake:x", "news"):
            assert not may(user, "PUBLISH", other, "") and not may(user, "SUBSCRIBE", other)
        assert not may(user, "PSUBSCRIBE", "optimus:*")
    # A node's own user reaches its own job's channels only; the shared one, every job's.
    assert not may("optimus-node-node0", "PUBLISH", "optimus:{k}:wake:controller", "")
    assert may("optimus-controller", "PUBLISH", agents, "")
    assert may("optimus-controller", "SUBSCRIBE", controller)
    assert not may("optimus-controller", "PUBLISH", "news", "")
    assert not may("optimus-operator", "PUBLISH", controller, "")
    assert not may("optimus-operator", "SUBSCRIBE", agents)
