"""What runs on every node: the agent (`optimus agent`), which starts, watches and stops the
ranks there, keeps their in-memory snapshots, collects their stacks and checks the tiles."""
