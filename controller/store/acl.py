"""Redis ACL users: one per node, whose password reaches that node's own keys and nothing an
agent could write elsewhere (docs/security.md, "One identity per node").

    optimus-node-<node>   ~optimus:{<job>}:node:<node>:*   read and write (own.py)
                          commands:<node>                  LPOP only
                          plan, plan:stamp, control, gen:* read only
                          channel wake:agents              SUBSCRIBE only (wake.py)
                          channel wake:controller          PUBLISH only

`optimus run` creates them in its private Redis (`create_node_users`); the Slurm and PBS scripts
write them into their Redis's ACL file (`python -m controller.store.acl JOB NODE...` prints the
lines, each password a placeholder `CHANGE-ME-node@<node>@` the script replaces, as it does for
the other users: no password on a command line). The shared `optimus-agent` user of
deploy/redis-users.acl stays for deployments that hand every node one password: it reaches
every node's own keys, so that one node's password can speak for another node (never for the
controller: the relay still takes each node's word about itself only).
"""

from __future__ import annotations

from controller.store.names import check, own

AGENT_READS = ("plan", "plan:stamp", "control", "gen:*")  # what an agent reads beside its own
# Categories as deploy/redis-users.acl grants the shared agent user, without keyless writes.
AGENT_COMMANDS = ("+@read", "+@write", "+@stream", "+@transaction", "+@connection",
                  "-@dangerous", "-@scripting")


def node_user(node: str) -> str:
    return f"optimus-node-{check(node)}"


def node_rules(job: str, node: str) -> list[str]:
    """The ACL SETUSER rules of `node`'s user, password aside. Node and job names hold no
    glob character (names.py; the job's name rule in optimus/config/schema.py)."""
    head = f"optimus:{{{job}}}:"
    return ["reset", "on", "resetkeys", f"~{head}{own(check(node), '*')}",
            *(f"%R~{head}{key}" for key in AGENT_READS), "resetchannels", "-@all",
            *AGENT_COMMANDS, f"(~{head}commands:{node} +lpop)",
            f"(&{head}wake:agents +subscribe +unsubscribe)", f"(&{head}wake:controller +publish)"]


def create_node_users(r, job: str, passwords: dict[str, str]) -> None:
    """Create (or replace) each node's user with its password, on connection `r` of a user
    allowed ACL SETUSER. The password goes over the connection, never on a command line."""
    for node, password in passwords.items():
        r.execute_command("ACL", "SETUSER", node_user(node), *node_rules(job, node),
                          f">{password}")


def file_lines(job: str, nodes: list[str]) -> list[str]:
    """The nodes' users as ACL file lines, each password the placeholder
    `CHANGE-ME-node@<node>@` ('@' is in no node name: one node's placeholder is never part of
    another's)."""
    return [" ".join(["user", node_user(n), *node_rules(job, n)[1:], f">CHANGE-ME-node@{n}@"])
            for n in nodes]


if __name__ == "__main__":  # the batch scripts' ACL file: python -m controller.store.acl JOB NODE
    import sys

    print("\n".join(file_lines(sys.argv[1], sys.argv[2:])))
