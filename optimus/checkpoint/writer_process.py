"""DCP's asynchronous writer process (PROCESS mode): kept quiet, and stopped before its rank exits.

On the first PROCESS-mode save `dcp.async_save` spawns one writer process per rank (torch's
`_AsyncCheckpointProcess`) and keeps it in a module global for the rest of the rank's life.
torch 2.13 has no call that stops it: its `__del__` asks it to exit only if the object is
collected before the interpreter ends, and multiprocessing's exit handler kills it otherwise;
a warm-forked rank leaves through os._exit (optimus/supervision/warm.py), which runs neither,
so the writer reads EOF from its pipe and dies with an `EOFError` traceback in the rank's log.
The writer also logs every request at INFO ("Waiting for checkpoint save request..."): torch
gives the child's root logger its own INFO handler on the rank's stderr.

What is done here is the least that fixes both. The names are private to torch's
`_async_process_executor`; pyproject pins torch to 2.13.x and tests/test_clean_exit.py fails on
a change:
- `install()` has DCP spawn `QuietWriterProcess`, torch's class with another entry point in the
  child: it drops the child's log records below WARNING (a filter on the root logger, where
  torch logs them), quiets torch's "distributed" logs (the child unpickles every DTensor's
  DeviceMesh and warns once per tensor that its process groups do not exist there) unless the
  user set TORCH_LOGS, then runs torch's own loop; EOF on its pipe (the rank died without
  saying goodbye: killed) ends it quietly too, and its process group is collected before the
  child's interpreter finalizes.
- `stop()` sends the writer DCP's own TERMINATE request and waits for it to exit.
- `install()` also gives DCP `unclaimed_port` to pick the writers' store port. DCP binds port 0,
  closes it and hands the number to the writer, which binds it only once spawned: seconds of
  imports later, far more on a loaded node. Meanwhile the kernel may give that very port to
  any outgoing connection of the host (their local ports come from the same ephemeral range),
  and the writers' rendezvous fails: the save fails (seen under a CPU hog: a process-mode
  run's first save lost, the later ones committed). `unclaimed_port` picks a free port below
  the ephemeral range, which the kernel never hands out by itself (optimus/supervision/ports.py).

PROCESS-mode saves stage into shared memory the writer reads in place (staging.py `Stager`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os

import torch

from optimus.supervision.ports import unclaimed_port

try:  # private names: another torch (a GPU image's) may lack them; then DCP's writer is as is
    import torch.distributed.checkpoint._async_process_executor as _executor

    _TORCH_WRITER = _executor._AsyncCheckpointProcess
except (ImportError, AttributeError):
    _executor, _TORCH_WRITER = None, object

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 60.0  # the writer finishes no save after TERMINATE: it only tears its group down


def _quiet_loop(pg_init_info, parent_conn) -> None:
    """The writer's entry point, in the child (see the top of this module)."""
    logging.getLogger().addFilter(lambda record: record.levelno >= logging.WARNING)
    if "TORCH_LOGS" not in os.environ:
        torch._logging.set_logs(distributed=logging.ERROR)
    with contextlib.suppress(EOFError):  # the rank is gone; torch's loop tore its group down
        _TORCH_WRITER._checkpointing_subprocess(pg_init_info, parent_conn)
    # The unpickled DeviceMeshes hold this process's group in reference cycles: free it now,
    # not during the interpreter's finalization (see the end of optimus/train.py's train()).
    gc.collect()


class QuietWriterProcess(_TORCH_WRITER):
    """torch's writer process, started through `_quiet_loop` (a module-level function, which
    the spawned child finds by name)."""

    _checkpointing_subprocess = staticmethod(_quiet_loop)


def install() -> None:
    """Make DCP spawn its writer process as `QuietWriterProcess`, on a store port from
    `unclaimed_port` (idempotent)."""
    if _executor is not None:
        _executor._AsyncCheckpointProcess = QuietWriterProcess
        if hasattr(_executor, "get_free_port"):
            _executor.get_free_port = unclaimed_port


def stop(kill: bool = False) -> None:
    """Ask this process's DCP writer process, if it started one, to exit, and wait for it.

    Call it with no save in flight (the writer answers TERMINATE only between requests). A
    writer that does not exit within STOP_TIMEOUT_S is killed; `kill`: at once (its save is
    dropped, and it may be blocked in a collective with a dead peer)."""
    if _executor is None:
        return
    writer, _executor._CHECKPOINT_PROCESS = getattr(_executor, "_CHECKPOINT_PROCESS", None), None
    if writer is None:
        return
    process = writer._save_process
    if process.is_alive() and not kill:
        with contextlib.suppress(OSError):  # it died meanwhile: its pipe is closed
            writer._send(_executor._CheckpointSaveProcessControlOpts.TERMINATE)
        process.join(STOP_TIMEOUT_S)
    if process.is_alive() and not kill:
        log.warning("DCP's checkpoint writer process %d did not exit within %.0f s; killed",
                    process.pid, STOP_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()
    writer._process_pipe.close()


