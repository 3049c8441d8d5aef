"""The `OPTIMUS_*` environment variables: every one any process of Optimus reads, named once.

An agent sets the first two groups for each rank it starts (controller/node/lifecycle.py); a
rank reads them (optimus/runtime/launch.py, optimus/supervision/). The others configure the
agent, the operator's commands, or a rank on a site.
"""

from __future__ import annotations

PREFIX = "OPTIMUS_"

# Where the rank sits in its generation (optimus.runtime.launch_env reads them first).
RANK = "OPTIMUS_RANK"
WORLD_SIZE = "OPTIMUS_WORLD_SIZE"
LOCAL_RANK = "OPTIMUS_LOCAL_RANK"
LOCAL_WORLD_SIZE = "OPTIMUS_LOCAL_WORLD_SIZE"
NODE_RANK = "OPTIMUS_NODE_RANK"
NUM_NODES = "OPTIMUS_NUM_NODES"
JOB_ID = "OPTIMUS_JOB_ID"
GENERATION = "OPTIMUS_GENERATION"
MASTER_ADDR = "OPTIMUS_MASTER_ADDR"
MASTER_PORT = "OPTIMUS_MASTER_PORT"

# The rank's channels to its agent, and what the plan carries into the generation.
AGENT_SOCKET = "OPTIMUS_AGENT_SOCKET"  # heartbeats: the agent's Unix datagram socket
AGENT_PID = "OPTIMUS_AGENT_PID"  # the agent, which may read this rank's stacks (ptrace)
CONTROL_FILE = "OPTIMUS_CONTROL_FILE"  # the control word: pause, checkpoint, "save": false
CHAOS_FILE = "OPTIMUS_CHAOS_FILE"  # an operator's faults for the rank to fire
NEXT_FILE = "OPTIMUS_NEXT_FILE"  # set: the rank waits in process for the next generation
QUORUM_FILE = "OPTIMUS_QUORUM_FILE"  # the replicas training together now (a Quorum record)
REPLICA = "OPTIMUS_REPLICA"  # which data-parallel replica the rank's world is
QUORUM_AFTER = "OPTIMUS_QUORUM_AFTER"  # a standby joins only a quorum newer than this id
REPLICA_LAUNCH = "OPTIMUS_REPLICA_LAUNCH"  # its replica's launch in the generation (0: first)
STACKS_FILE = "OPTIMUS_STACKS_FILE"  # where SIGUSR1 dumps the rank's stacks
FAILED_SAVES = "OPTIMUS_FAILED_SAVES"  # checkpoint saves failed in a row so far
SKIP_STEPS = "OPTIMUS_SKIP_STEPS"  # "A-B,C-D": the steps whose batches a rewind skips
SNAPSHOT_DIR = "OPTIMUS_SNAPSHOT_DIR"  # where the rank writes in-memory snapshots
SNAPSHOT_RESUME = "OPTIMUS_SNAPSHOT_RESUME"  # JSON: the snapshot point the rank resumes from

# A site's, for its ranks.
CPU_BIND = "OPTIMUS_CPU_BIND"  # the CPUs of each local rank

# The agent's own.
WARM_START = "OPTIMUS_WARM_START"  # fork, standby or cold (controller/node/spawn.py)
WARM_COMMAND = "OPTIMUS_WARM_COMMAND"  # a JSON list: the command that starts the warm process
PY_SPY = "OPTIMUS_PY_SPY"  # the py-spy to read a hung rank's stacks with (empty: none)
HOST = "OPTIMUS_HOST"  # the address the agent advertises (`optimus agent --host`)
INTERFACE = "OPTIMUS_INTERFACE"  # the ranks' network interface (`optimus agent --interface`)
SNAPSHOT_SECRET = "OPTIMUS_SNAPSHOT_SECRET"  # the job's snapshot key (never a rank's)
SNAPSHOT_SECRET_FILE = "OPTIMUS_SNAPSHOT_SECRET_FILE"  # or a file holding it
SNAPSHOT_PORT = "OPTIMUS_SNAPSHOT_PORT"  # where the snapshot server listens
SNAPSHOT_TLS_CERT = "OPTIMUS_SNAPSHOT_TLS_CERT"
SNAPSHOT_TLS_KEY = "OPTIMUS_SNAPSHOT_TLS_KEY"
SNAPSHOT_TLS_CA = "OPTIMUS_SNAPSHOT_TLS_CA"

# An operator's.
JOB = "OPTIMUS_JOB"  # the job's name, for every `optimus` command that takes --job

# Set for a rank by its agent: the launch and the channels above.
LAUNCH = (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, NUM_NODES, JOB_ID,
          GENERATION, MASTER_ADDR, MASTER_PORT)
